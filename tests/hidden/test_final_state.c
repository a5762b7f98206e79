/* The target's final state in a hidden-state store (dflash_hidden_writer_options.final_state):
 * written and read back bit for bit (bf16 and fp8, from float32 and bf16 rows), through the
 * sample stream as dflash_sample.target_final; stores without it (every store before) read as
 * before and say they have none; a store that claims it but is malformed or truncated gets a
 * status naming the file and what is wrong. */
#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/safetensors.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/bf16.h"
#include "core/internal.h"
#include "testutil.h"

enum { K = 2, H = 8 };

#define ck_assert_str_contains(hay, needle) \
  ck_assert_msg(strstr((hay), (needle)) != NULL, "\"%s\" lacks \"%s\"", (hay), (needle))

/* The whole file at `path`, NUL-terminated (malloc'd). */
static char *read_text(const char *path) {
  FILE *fp = fopen(path, "rb");
  ck_assert_ptr_nonnull(fp);
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char *text = malloc((size_t)n + 1);
  ck_assert_uint_eq(fread(text, 1, (size_t)n, fp), (size_t)n);
  text[n] = 0;
  fclose(fp);
  return text;
}

static float val(int64_t i, int salt) { return sinf(0.37f * (float)i + (float)salt) * 3.0f; }

static float *rows(int64_t len, int width, int salt) {
  float *x = malloc((size_t)len * width * sizeof *x);
  for (int64_t i = 0; i < len * width; i++) x[i] = val(i, salt);
  return x;
}

static dflash_status add(dflash_hidden_writer *w, const char *id, const float *x, const float *f,
                         int64_t len) {
  dflash_hidden_rows r;
  dflash_hidden_rows_default(&r);
  r.len = len, r.states = x, r.final_state = f;
  return dflash_hidden_writer_add(w, id, &r);
}

/* What an fp8 store keeps of a row of H values: e4m3 codes with the scale amax / 448. */
static void fp8_row(const float *x, float *out) {
  float amax = 0;
  for (int i = 0; i < H; i++) amax = fmaxf(amax, fabsf(x[i]));
  float scale = amax > 0 ? amax / 448.0f : 1.0f;
  for (int i = 0; i < H; i++) out[i] = df_e4m3_to_f32(df_f32_to_e4m3(x[i] / scale)) * scale;
}

static void assert_bits_eq(const float *a, const float *b, size_t n, const char *what) {
  ck_assert_msg(!memcmp(a, b, n * sizeof *a), "%s differs", what);
}

/* Written, read back bit for bit: layers and final state, bf16 (from float32 and from bf16
 * bits) and fp8; the index and the shards say "final_state": "post_norm". */
START_TEST(final_state_round_trip) {
  for (int fp8 = 0; fp8 < 2; fp8++) {
    char *dir = df_test_tmpdir();
    dflash_hidden_writer_options o;
    dflash_hidden_writer_options_default(&o);
    o.final_state = 1, o.dtype = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
    o.shard_bytes = 600; /* a shard every sample or two */
    dflash_hidden_writer *w;
    ck_assert_ok(dflash_hidden_writer_create(dir, K, H, &o, &w));
    float *x[4], *f[4];
    uint16_t *xb = NULL, *fb = NULL;
    for (int s = 0; s < 4; s++) {
      char id[16];
      snprintf(id, sizeof id, "s%d", s);
      x[s] = rows(5 + s, K * H, s), f[s] = rows(5 + s, H, 10 + s);
      if (s < 3) {
        ck_assert_ok(add(w, id, x[s], f[s], 5 + s));
        continue;
      }
      /* bf16 rows (as a target produces them) */
      xb = malloc((size_t)(5 + s) * K * H * 2), fb = malloc((size_t)(5 + s) * H * 2);
      for (int i = 0; i < (5 + s) * K * H; i++) xb[i] = df_f32_to_bf16(x[s][i]);
      for (int i = 0; i < (5 + s) * H; i++) fb[i] = df_f32_to_bf16(f[s][i]);
      dflash_hidden_rows r;
      dflash_hidden_rows_default(&r);
      r.dtype = DFLASH_DTYPE_BF16, r.len = 5 + s, r.states = xb, r.final_state = fb;
      ck_assert_ok(dflash_hidden_writer_add(w, id, &r));
    }
    ck_assert_ok(dflash_hidden_writer_commit(w));
    dflash_hidden_writer_free(w);
    dflash_hidden *h;
    ck_assert_ok(dflash_hidden_open(dir, &h));
    dflash_hidden_info info = {.struct_size = sizeof info};
    ck_assert_ok(dflash_hidden_get_info(h, &info));
    ck_assert_uint_eq(info.count, 4);
    ck_assert_int_eq(info.final_state, 1);
    for (int s = 0; s < 4; s++) {
      char id[16];
      snprintf(id, sizeof id, "s%d", s);
      int64_t len = 5 + s;
      float *gx = malloc((size_t)len * K * H * sizeof *gx), *gf = malloc((size_t)len * H * 4);
      float *wx = malloc((size_t)len * K * H * sizeof *wx), *wf = malloc((size_t)len * H * 4);
      for (int64_t r = 0; r < len * K; r++) {
        if (fp8) fp8_row(x[s] + r * H, wx + r * H);
        else
          for (int i = 0; i < H; i++)
            wx[r * H + i] = df_bf16_to_f32(df_f32_to_bf16(x[s][r * H + i]));
      }
      for (int64_t r = 0; r < len; r++) {
        float in[H];
        for (int i = 0; i < H; i++) /* s3 came as bf16 bits: the store starts from those */
          in[i] = s == 3 ? df_bf16_to_f32(fb[r * H + i]) : f[s][r * H + i];
        if (fp8) fp8_row(in, wf + r * H);
        else
          for (int i = 0; i < H; i++) wf[r * H + i] = df_bf16_to_f32(df_f32_to_bf16(in[i]));
      }
      if (fp8 && s == 3) /* the layers too start from the bf16 bits */
        for (int64_t r = 0; r < len * K; r++) {
          float in[H];
          for (int i = 0; i < H; i++) in[i] = df_bf16_to_f32(xb[r * H + i]);
          fp8_row(in, wx + r * H);
        }
      ck_assert_ok(dflash_hidden_read(h, id, gx, len));
      ck_assert_ok(dflash_hidden_read_final_state(h, id, gf, len));
      assert_bits_eq(gx, wx, (size_t)len * K * H, "layers");
      assert_bits_eq(gf, wf, (size_t)len * H, "final state");
      if (!fp8 && s == 3)
        for (int i = 0; i < (int)len * H; i++) ck_assert_uint_eq(df_f32_to_bf16(gf[i]), fb[i]);
      ck_assert_status(dflash_hidden_read_final_state(h, id, gf, len - 1), DFLASH_E_FORMAT,
                       "final state of sample");
      free(gx), free(gf), free(wx), free(wf);
    }
    dflash_hidden_free(h);
    /* The metadata, in the index and in every shard. */
    dflash_safetensors *st;
    ck_assert_ok(dflash_safetensors_open(dir, &st));
    const char *v;
    ck_assert_ok(dflash_safetensors_metadata_find(st, "final_state", &v));
    ck_assert_str_eq(v, "post_norm");
    dflash_safetensors_free(st);
    char *shard = df_path_join(dir, "hidden-00000.safetensors");
    ck_assert_ok(dflash_safetensors_open(shard, &st));
    ck_assert_ok(dflash_safetensors_metadata_find(st, "final_state", &v));
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_safetensors_find(st, "f/s0", &t));
    ck_assert_int_eq(t.shape[0], 5);
    ck_assert_int_eq(t.shape[1], H);
    ck_assert_int_eq(t.dtype, fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16);
    if (fp8) ck_assert_ok(dflash_safetensors_find(st, "fs/s0", &t));
    dflash_safetensors_free(st);
    free(shard);
    for (int s = 0; s < 4; s++) free(x[s]), free(f[s]);
    free(xb), free(fb);
    df_test_rmtree(dir);
    free(dir);
  }
}
END_TEST

/* What the writer refuses: a final state missing or unasked for, NaN/Inf in it, a bad option
 * value, and appending across the two kinds of store. (A spool takes it: the spool tests.) */
START_TEST(final_state_writer_refusals) {
  char *dir = df_test_tmpdir(), *plain = df_test_tmpdir();
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.final_state = 2;
  dflash_hidden_writer *w;
  ck_assert_status(dflash_hidden_writer_create(dir, K, H, &o, &w), DFLASH_E_INVALID_ARG,
                   "final_state is 2");
  o.final_state = 1;
  ck_assert_ok(dflash_hidden_writer_create(dir, K, H, &o, &w));
  float *x = rows(4, K * H, 0), *f = rows(4, H, 1);
  ck_assert_status(add(w, "a", x, NULL, 4), DFLASH_E_INVALID_ARG, "sample a: ");
  ck_assert_str_contains(dflash_last_error(), "rows.final_state is NULL");
  f[9] = NAN;
  ck_assert_status(add(w, "a", x, f, 4), DFLASH_E_FORMAT,
                   "sample a: final state at token 1, column 1 is NaN");
  f[9] = 0.5f;
  ck_assert_ok(add(w, "a", x, f, 4));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  /* A store with the final state is appended to only with it, and the other way round. */
  ck_assert_status(dflash_hidden_writer_create(dir, K, H, NULL, &w), DFLASH_E_MISMATCH,
                   "holds the target's final state");
  ck_assert_ok(dflash_hidden_writer_create(plain, K, H, NULL, &w));
  ck_assert_status(add(w, "a", x, f, 4), DFLASH_E_INVALID_ARG, "created without final_state");
  ck_assert_ok(add(w, "a", x, NULL, 4));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  ck_assert_status(dflash_hidden_writer_create(plain, K, H, &o, &w), DFLASH_E_MISMATCH,
                   "does not hold the target's final state");
  free(x), free(f);
  df_test_rmtree(dir), df_test_rmtree(plain);
  free(dir), free(plain);
}
END_TEST

/* A store without the final state (the format every earlier libdflash wrote: no
 * "final_state" key, no f/ tensors) reads as before and says it has none. */
START_TEST(old_store_reads_without_final_state) {
  char *dir = df_test_tmpdir();
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(dir, K, H, NULL, &w));
  float *x = rows(6, K * H, 0), got[6 * K * H];
  ck_assert_ok(add(w, "old", x, NULL, 6));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  char *index = df_path_join(dir, "hidden.safetensors.index.json");
  char *text = read_text(index);
  ck_assert_ptr_null(strstr(text, "final_state"));
  free(text), free(index);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(dir, &h));
  /* an older caller's struct (no final_state field) is filled up to its size */
  dflash_hidden_info info;
  memset(&info, 0x5a, sizeof info);
  info.struct_size = offsetof(dflash_hidden_info, final_state);
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  ck_assert_uint_eq(info.count, 1);
  ck_assert_int_eq(info.final_state, 0x5a5a5a5a);
  info.struct_size = sizeof info;
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  ck_assert_int_eq(info.final_state, 0);
  ck_assert_ok(dflash_hidden_read(h, "old", got, 6));
  for (int i = 0; i < 6 * K * H; i++)
    ck_assert_float_eq(got[i], df_bf16_to_f32(df_f32_to_bf16(x[i])));
  ck_assert_status(dflash_hidden_read_final_state(h, "old", got, 6), DFLASH_E_NOT_FOUND,
                   "holds no target final state");
  dflash_hidden_free(h);
  free(x);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* A hand-made store: samples "a" and "b" (4 tokens, K x H bf16 rows); `meta` the
 * final_state metadata value (NULL: none); f/ tensors for the ids in `fin` (a
 * comma-free list of single letters), of dtype fdt and shape [4, fw]. */
static void make_store(const char *dir, const char *meta, const char *fin, int32_t fdt,
                       int64_t fw) {
  ck_assert_int_eq(mkdir(dir, 0755), 0);
  char *shard = df_path_join(dir, "hidden-00000.safetensors");
  dflash_safetensors_writer *sw;
  ck_assert_ok(dflash_safetensors_writer_create(shard, &sw));
  char k[8], h[8];
  snprintf(k, sizeof k, "%d", K), snprintf(h, sizeof h, "%d", H);
  const char *keys[5] = {"format", "num_layers", "hidden_size", "dtype", "final_state"};
  const char *vals[5] = {"dflash-hidden-1", k, h, "bf16", meta};
  size_t nm = meta ? 5 : 4;
  for (size_t i = 0; i < nm; i++)
    ck_assert_ok(dflash_safetensors_writer_metadata(sw, keys[i], vals[i]));
  int64_t hs[2] = {4, K * H}, fs[2] = {4, fw};
  ck_assert_ok(dflash_safetensors_writer_declare(sw, "h/a", DFLASH_DTYPE_BF16, 2, hs));
  ck_assert_ok(dflash_safetensors_writer_declare(sw, "h/b", DFLASH_DTYPE_BF16, 2, hs));
  char name[8];
  for (const char *c = fin; *c; c++) {
    snprintf(name, sizeof name, "f/%c", *c);
    ck_assert_ok(dflash_safetensors_writer_declare(sw, name, fdt, 2, fs));
  }
  uint16_t buf[4 * K * H * 2];
  for (size_t i = 0; i < sizeof buf / 2; i++) buf[i] = df_f32_to_bf16(val((int64_t)i, 3));
  ck_assert_ok(dflash_safetensors_writer_write(sw, buf, 4 * K * H * 2));
  ck_assert_ok(dflash_safetensors_writer_write(sw, buf, 4 * K * H * 2));
  for (const char *c = fin; *c; c++)
    ck_assert_ok(
        dflash_safetensors_writer_write(sw, buf, (size_t)(4 * fw) * dflash_dtype_size(fdt)));
  ck_assert_ok(dflash_safetensors_writer_commit(sw));
  dflash_safetensors_writer_free(sw);
  char *index = df_path_join(dir, "hidden.safetensors.index.json");
  const char *shards[1] = {"hidden-00000.safetensors"};
  ck_assert_ok(dflash_safetensors_write_index(index, 1, shards, nm, keys, vals));
  free(index), free(shard);
}

/* A store that claims the final state but does not hold it whole, or holds it wrong: each a
 * clear status naming the store or the file, and what is wrong. */
START_TEST(malformed_final_state_named) {
  char *root = df_test_tmpdir();
  float out[4 * H];
  dflash_hidden *h;
  int n = 0;
  char dir[4096];
#define FRESH() (snprintf(dir, sizeof dir, "%s/s%d", root, n++), dir)
  /* declared, one sample without it */
  make_store(FRESH(), "post_norm", "a", DFLASH_DTYPE_BF16, H);
  ck_assert_status(dflash_hidden_open(dir, &h), DFLASH_E_FORMAT,
                   "declares final_state, but holds 1 final-state tensors (f/<id>) for 2 samples");
  ck_assert_str_contains(dflash_last_error(), dir);
  /* declared, counts equal, but one belongs to no sample: named when that sample is read */
  make_store(FRESH(), "post_norm", "az", DFLASH_DTYPE_BF16, H);
  ck_assert_ok(dflash_hidden_open(dir, &h));
  ck_assert_ok(dflash_hidden_read_final_state(h, "a", out, 4));
  ck_assert_status(dflash_hidden_read_final_state(h, "b", out, 4), DFLASH_E_FORMAT,
                   "sample b has no final state (f/b), though the store declares final_state");
  ck_assert_str_contains(dflash_last_error(), "hidden-00000.safetensors");
  dflash_hidden_free(h);
  /* f/ tensors the metadata does not declare */
  make_store(FRESH(), NULL, "ab", DFLASH_DTYPE_BF16, H);
  ck_assert_status(dflash_hidden_open(dir, &h), DFLASH_E_FORMAT,
                   "2 final-state tensors (f/<id>), but the metadata does not declare "
                   "final_state");
  /* another convention (speculators store the pre-norm state) */
  make_store(FRESH(), "pre_norm", "ab", DFLASH_DTYPE_BF16, H);
  ck_assert_status(dflash_hidden_open(dir, &h), DFLASH_E_FORMAT,
                   "metadata final_state = \"pre_norm\"");
  /* wrong dtype, wrong width: named with the shard and the sample */
  make_store(FRESH(), "post_norm", "ab", DFLASH_DTYPE_F32, H);
  ck_assert_ok(dflash_hidden_open(dir, &h));
  ck_assert_status(dflash_hidden_read_final_state(h, "b", out, 4), DFLASH_E_FORMAT,
                   "hidden-00000.safetensors: final state of sample b is not BF16 [4, 8]");
  dflash_hidden_free(h);
  make_store(FRESH(), "post_norm", "ab", DFLASH_DTYPE_BF16, H - 1);
  ck_assert_ok(dflash_hidden_open(dir, &h));
  ck_assert_status(dflash_hidden_read_final_state(h, "a", out, 4), DFLASH_E_FORMAT,
                   "final state of sample a is not BF16 [4, 8]");
  dflash_hidden_free(h);
  /* truncated: the shard ends inside its final-state tensors */
  make_store(FRESH(), "post_norm", "ab", DFLASH_DTYPE_BF16, H);
  char *shard = df_path_join(dir, "hidden-00000.safetensors");
  struct stat sb;
  ck_assert_int_eq(stat(shard, &sb), 0);
  ck_assert_int_eq(truncate(shard, sb.st_size - 10), 0);
  ck_assert_status(dflash_hidden_open(dir, &h), DFLASH_E_TRUNCATED, "hidden-00000.safetensors");
  ck_assert_str_contains(dflash_last_error(), "tensor \"f/b\"");
  free(shard);
#undef FRESH
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* An fp8 store's final state needs its scales: named when they are missing. */
START_TEST(fp8_final_state_without_scales_named) {
  char *dir = df_test_tmpdir();
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.final_state = 1, o.dtype = DFLASH_DTYPE_F8_E4M3;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(dir, K, H, &o, &w));
  float *x = rows(4, K * H, 0), *f = rows(4, H, 1), out[4 * H];
  ck_assert_ok(add(w, "a", x, f, 4));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  /* Rewrite the shard without "fs/a" (the rest as written). */
  char *shard = df_path_join(dir, "hidden-00000.safetensors");
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(shard, &st));
  char *copy = df_path_join(dir, "copy.tmp");
  dflash_safetensors_writer *sw;
  ck_assert_ok(dflash_safetensors_writer_create(copy, &sw));
  for (size_t i = 0; i < dflash_safetensors_metadata_count(st); i++) {
    const char *k, *v;
    ck_assert_ok(dflash_safetensors_metadata_get(st, i, &k, &v));
    ck_assert_ok(dflash_safetensors_writer_metadata(sw, k, v));
  }
  size_t nt = dflash_safetensors_count(st);
  for (int pass = 0; pass < 2; pass++)
    for (size_t i = 0; i < nt; i++) {
      dflash_tensor t = {.struct_size = sizeof t};
      ck_assert_ok(dflash_safetensors_get(st, i, &t));
      if (!strcmp(t.name, "fs/a")) continue;
      if (!pass)
        ck_assert_ok(
            dflash_safetensors_writer_declare(sw, t.name, t.dtype, (int32_t)t.ndim, t.shape));
      else ck_assert_ok(dflash_safetensors_writer_write(sw, t.data, t.nbytes));
    }
  ck_assert_ok(dflash_safetensors_writer_commit(sw));
  dflash_safetensors_writer_free(sw);
  dflash_safetensors_free(st);
  ck_assert_int_eq(rename(copy, shard), 0);
  /* and the index, which lists every tensor */
  dflash_safetensors *ix;
  char *index = df_path_join(dir, "hidden.safetensors.index.json");
  char *names[1] = {"hidden-00000.safetensors"};
  ck_assert_ok(dflash_safetensors_open(shard, &ix));
  const char *keys[8], *vals[8];
  size_t nm = dflash_safetensors_metadata_count(ix);
  ck_assert_uint_le(nm, 8);
  for (size_t i = 0; i < nm; i++)
    ck_assert_ok(dflash_safetensors_metadata_get(ix, i, &keys[i], &vals[i]));
  ck_assert_ok(
      dflash_safetensors_write_index(index, 1, (const char *const *)names, nm, keys, vals));
  dflash_safetensors_free(ix);
  free(index);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(dir, &h));
  ck_assert_status(dflash_hidden_read_final_state(h, "a", out, 4), DFLASH_E_FORMAT,
                   "final state of sample a lacks its scales (fs/a)");
  ck_assert_str_contains(dflash_last_error(), "hidden-00000.safetensors");
  dflash_hidden_free(h);
  free(x), free(f), free(shard), free(copy);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* The sample stream gives each sample its final state as dflash_sample.target_final (the
 * stored values), and NULL from a store without it. */
START_TEST(stream_gives_target_final) {
  char *root = df_test_tmpdir();
  char *data = df_path_join(root, "data"), *fin = df_path_join(root, "fin"),
       *plain = df_path_join(root, "plain");
  dflash_dataset_writer *dw;
  ck_assert_ok(dflash_dataset_writer_create(data, NULL, &dw));
  int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t mask[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  ck_assert_ok(dflash_dataset_writer_add(dw, "p", ids, mask, 8));
  ck_assert_ok(dflash_dataset_writer_add(dw, "q", ids, mask, 8));
  ck_assert_ok(dflash_dataset_writer_commit(dw));
  dflash_dataset_writer_free(dw);
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.final_state = 1;
  dflash_hidden_writer *w, *wp;
  ck_assert_ok(dflash_hidden_writer_create(fin, K, H, &o, &w));
  ck_assert_ok(dflash_hidden_writer_create(plain, K, H, NULL, &wp));
  float *x = rows(8, K * H, 0), *f[2] = {rows(8, H, 1), rows(8, H, 2)};
  ck_assert_ok(add(w, "p", x, f[0], 8));
  ck_assert_ok(add(w, "q", x, f[1], 8));
  ck_assert_ok(add(wp, "p", x, NULL, 8));
  ck_assert_ok(add(wp, "q", x, NULL, 8));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  ck_assert_ok(dflash_hidden_writer_commit(wp));
  dflash_hidden_writer_free(w);
  dflash_hidden_writer_free(wp);
  for (int stored = 0; stored < 2; stored++) {
    dflash_sample_stream_options so;
    dflash_sample_stream_options_default(&so);
    so.stored_rows = stored;
    dflash_sample_stream *s;
    ck_assert_ok(dflash_sample_stream_open(data, fin, &so, &s));
    uint64_t order[3] = {1, 0, 1};
    ck_assert_ok(dflash_sample_stream_start(s, order, 3));
    for (int k = 0; k < 3; k++) {
      dflash_sample smp = {.struct_size = sizeof smp};
      int32_t done;
      ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
      ck_assert_int_eq(done, 0);
      ck_assert_ptr_nonnull(smp.target_final);
      const float *want = f[order[k]];
      for (int i = 0; i < 8 * H; i++)
        ck_assert_float_eq(smp.target_final[i], df_bf16_to_f32(df_f32_to_bf16(want[i])));
    }
    dflash_sample_stream_free(s);
    ck_assert_ok(dflash_sample_stream_open(data, plain, &so, &s));
    ck_assert_ok(dflash_sample_stream_start(s, order, 1));
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t done;
    ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
    ck_assert_ptr_null(smp.target_final);
    dflash_sample_stream_free(s);
  }
  free(x), free(f[0]), free(f[1]);
  free(data), free(fin), free(plain);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* ---- the spool (dflash_hidden_writer_options.spool_budget) with the final state ---------- */

/* What a spool's consumer may give back for a final-state value `in` (a row's amax `amax`),
 * bounded from the formats alone, not from the library's codec: bf16 rounds to 8 significant
 * bits (half an ulp: 2^-8 of the value); fp8 e4m3 of in / scale (scale = amax / 448) to 4
 * significant bits while normal (2^-4 of the value), and to steps of 2^-9 below 2^-6
 * (subnormal: half a step, 2^-10, times the scale). */
static float quant_bound(int fp8, float in, float amax) {
  float v = fabsf(in);
  if (!fp8) return v * 0x1p-8f;
  float scale = amax > 0 ? amax / 448.0f : 1.0f;
  return fmaxf(v * 0x1p-4f, scale * 0x1p-10f) + v * 1e-6f;
}

static char *spool_file(const char *sp, const char *name) { return df_path_join(sp, name); }

/* A spool written with final_state: spool.json and every shard say so; the shards read as a
 * store (dflash_hidden_open of the folder, dflash_hidden_read_final_state); the consumer
 * (dflash_spool_next, float32 and stored rows) gives every sample its final state as
 * target_final, bit for bit what the store reads and within the format's bound of what was
 * written; dflash_spool_info says final_state 1 (an older caller's struct is filled up to its
 * size). bf16 and fp8, float32 input and bf16 bits, several shards. */
START_TEST(spool_final_state_round_trip) {
  enum { N = 5 };
  for (int fp8 = 0; fp8 < 2; fp8++) {
    char *root = df_test_tmpdir(), *sp = df_path_join(root, "spool");
    dflash_hidden_writer_options o;
    dflash_hidden_writer_options_default(&o);
    o.final_state = 1, o.dtype = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
    o.shard_bytes = 300, o.spool_budget = 1 << 20; /* a shard every sample or two */
    dflash_hidden_writer *w;
    ck_assert_ok(dflash_hidden_writer_create(sp, K, H, &o, &w));
    float *x[N], *f[N];
    uint16_t *xb = NULL, *fb = NULL;
    for (int s = 0; s < N; s++) {
      char id[16];
      int64_t len = 5 + s;
      snprintf(id, sizeof id, "s%d", s);
      x[s] = rows(len, K * H, s), f[s] = rows(len, H, 10 + s);
      for (int64_t i = 0; i < len * H; i++) f[s][i] *= (float)(1 + 40 * s); /* magnitudes */
      if (s < N - 1) {
        ck_assert_ok(add(w, id, x[s], f[s], len));
        continue;
      }
      xb = malloc((size_t)len * K * H * 2), fb = malloc((size_t)len * H * 2);
      for (int64_t i = 0; i < len * K * H; i++) xb[i] = df_f32_to_bf16(x[s][i]);
      for (int64_t i = 0; i < len * H; i++) fb[i] = df_f32_to_bf16(f[s][i]);
      dflash_hidden_rows r;
      dflash_hidden_rows_default(&r);
      r.dtype = DFLASH_DTYPE_BF16, r.len = len, r.states = xb, r.final_state = fb;
      ck_assert_ok(dflash_hidden_writer_add(w, id, &r));
    }
    ck_assert_ok(dflash_hidden_writer_end_epoch(w));
    ck_assert_ok(dflash_hidden_writer_commit(w));
    dflash_hidden_writer_free(w);
    /* spool.json and the first shard's metadata */
    char *meta = spool_file(sp, "spool.json"), *text = read_text(meta);
    ck_assert_str_contains(text, ", \"final_state\": \"post_norm\"}");
    char *shard = spool_file(sp, "e00000-s000000.safetensors"),
         *shard2 = spool_file(sp, "e00000-s000002.safetensors");
    ck_assert_int_eq(access(shard2, F_OK), 0); /* several shards */
    dflash_safetensors *st;
    ck_assert_ok(dflash_safetensors_open(shard, &st));
    const char *v;
    ck_assert_ok(dflash_safetensors_metadata_find(st, "final_state", &v));
    ck_assert_str_eq(v, "post_norm");
    dflash_safetensors_free(st);
    /* The shards as a store: every sample's final state, within the format's bound. */
    dflash_hidden *h;
    ck_assert_ok(dflash_hidden_open(sp, &h));
    dflash_hidden_info hi = {.struct_size = sizeof hi};
    ck_assert_ok(dflash_hidden_get_info(h, &hi));
    ck_assert_uint_eq(hi.count, N);
    ck_assert_int_eq(hi.final_state, 1);
    float *gf[N];
    for (int s = 0; s < N; s++) {
      char id[16];
      int64_t len = 5 + s;
      snprintf(id, sizeof id, "s%d", s);
      gf[s] = malloc((size_t)len * H * sizeof *gf[s]);
      ck_assert_ok(dflash_hidden_read_final_state(h, id, gf[s], len));
      for (int64_t r = 0; r < len; r++) {
        float in[H], amax = 0;
        for (int i = 0; i < H; i++) {
          in[i] = s == N - 1 ? df_bf16_to_f32(fb[r * H + i]) : f[s][r * H + i];
          amax = fmaxf(amax, fabsf(in[i]));
        }
        for (int i = 0; i < H; i++) {
          float got = gf[s][r * H + i], bound = quant_bound(fp8, in[i], amax);
          if (!fp8 && s == N - 1) bound = 0; /* bf16 bits into a bf16 spool: kept */
          ck_assert_msg(fabsf(got - in[i]) <= bound,
                        "%s: sample %s token %lld column %d: %g read, %g written (bound %g)",
                        fp8 ? "fp8" : "bf16", id, (long long)r, i, got, in[i], bound);
        }
      }
    }
    dflash_hidden_free(h);
    /* The consumer: float32 rows, then rows as stored; the final state is float32 either way. */
    for (int stored = 0; stored < 2; stored++) {
      dflash_spool_options so;
      dflash_spool_options_default(&so);
      so.wait_s = 0, so.stored_rows = stored;
      dflash_spool *c;
      ck_assert_ok(dflash_spool_open(sp, &so, &c));
      dflash_spool_info si;
      memset(&si, 0x5a, sizeof si);
      si.struct_size = offsetof(dflash_spool_info, final_state); /* an older caller's */
      ck_assert_ok(dflash_spool_get_info(c, &si));
      ck_assert_int_eq(si.hidden_size, H);
      ck_assert_int_eq(si.final_state, 0x5a5a5a5a);
      si.struct_size = sizeof si;
      ck_assert_ok(dflash_spool_get_info(c, &si));
      ck_assert_int_eq(si.final_state, 1);
      for (int s = 0; s <= N; s++) {
        dflash_sample smp = {.struct_size = sizeof smp};
        int32_t end;
        ck_assert_ok(dflash_spool_next(c, &smp, &end));
        ck_assert_int_eq(end, s == N);
        if (end) break;
        char id[16];
        snprintf(id, sizeof id, "s%d", s);
        ck_assert_str_eq(smp.id, id);
        ck_assert_int_eq(smp.len, 5 + s);
        ck_assert_ptr_nonnull(smp.target_final);
        assert_bits_eq(smp.target_final, gf[s], (size_t)smp.len * H, "spool's final state");
        if (stored) ck_assert_ptr_nonnull(smp.hidden_codes);
        else ck_assert_float_eq_tol(smp.hidden[3], x[s][3], 0.3f);
      }
      dflash_spool_free(c);
    }
    for (int s = 0; s < N; s++) free(x[s]), free(f[s]), free(gf[s]);
    free(xb), free(fb), free(meta), free(text), free(shard), free(shard2), free(sp);
    df_test_rmtree(root);
    free(root);
  }
}
END_TEST

/* A spool without the final state reads as every spool before: its spool.json is the old
 * one byte for byte, info says 0, samples come with target_final NULL, and the shards as a
 * store say they have none. A spool is appended to only by a producer of its own kind, and a
 * producer with the option refuses a sample without it, naming the sample. */
START_TEST(spool_without_final_state_and_refusals) {
  char *root = df_test_tmpdir(), *sp = df_path_join(root, "plain"),
       *fsp = df_path_join(root, "final");
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.shard_bytes = 1 << 12, o.spool_budget = 1 << 20;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(sp, K, H, &o, &w));
  float *x = rows(4, K * H, 0), *f = rows(4, H, 1);
  ck_assert_status(add(w, "a", x, f, 4), DFLASH_E_INVALID_ARG, "created without final_state");
  ck_assert_ok(add(w, "a", x, NULL, 4));
  ck_assert_ok(dflash_hidden_writer_end_epoch(w));
  dflash_hidden_writer_free(w);
  char *meta = spool_file(sp, "spool.json"), *text = read_text(meta);
  ck_assert_str_eq(text, "{\"format\": \"dflash-spool-1\", \"num_layers\": 2, \"hidden_size\": 8, "
                         "\"dtype\": \"bf16\"}\n");
  dflash_spool *c;
  dflash_spool_options so;
  dflash_spool_options_default(&so);
  so.wait_s = 0;
  ck_assert_ok(dflash_spool_open(sp, &so, &c));
  dflash_spool_info si = {.struct_size = sizeof si};
  ck_assert_ok(dflash_spool_get_info(c, &si));
  ck_assert_int_eq(si.final_state, 0);
  dflash_sample smp = {.struct_size = sizeof smp};
  int32_t end;
  ck_assert_ok(dflash_spool_next(c, &smp, &end));
  ck_assert_int_eq(end, 0);
  ck_assert_str_eq(smp.id, "a");
  ck_assert_ptr_null(smp.target_final);
  for (int i = 0; i < 4 * K * H; i++)
    ck_assert_float_eq(smp.hidden[i], df_bf16_to_f32(df_f32_to_bf16(x[i])));
  dflash_spool_free(c);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(sp, &h));
  float got[4 * H];
  ck_assert_status(dflash_hidden_read_final_state(h, "a", got, 4), DFLASH_E_NOT_FOUND,
                   "holds no target final state");
  dflash_hidden_free(h);
  /* Producers of the other kind: refused on either spool, naming its spool.json. */
  o.final_state = 1;
  ck_assert_status(dflash_hidden_writer_create(sp, K, H, &o, &w), DFLASH_E_MISMATCH, "spool.json");
  ck_assert_str_contains(dflash_last_error(), "final_state 1");
  ck_assert_ok(dflash_hidden_writer_create(fsp, K, H, &o, &w));
  ck_assert_status(add(w, "b", x, NULL, 4), DFLASH_E_INVALID_ARG, "sample b: ");
  ck_assert_str_contains(dflash_last_error(), "rows.final_state is NULL");
  ck_assert_int_eq(dflash_hidden_writer_contains(w, "b"), 0); /* not taken */
  f[6] = INFINITY;
  ck_assert_status(add(w, "b", x, f, 4), DFLASH_E_FORMAT,
                   "sample b: final state at token 0, column 6 is Inf");
  f[6] = 0.25f;
  ck_assert_ok(add(w, "b", x, f, 4));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  o.final_state = 0;
  ck_assert_status(dflash_hidden_writer_create(fsp, K, H, &o, &w), DFLASH_E_MISMATCH, "spool.json");
  ck_assert_str_contains(dflash_last_error(), "final_state 0");
  o.final_state = 1; /* its own kind reopens it, and knows "b" */
  ck_assert_ok(dflash_hidden_writer_create(fsp, K, H, &o, &w));
  ck_assert_int_eq(dflash_hidden_writer_contains(w, "b"), 1);
  dflash_hidden_writer_free(w);
  free(x), free(f), free(meta), free(text), free(sp), free(fsp);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* A hand-made spool at `dir`: spool.json with final_state `meta` (NULL: none), one shard
 * e00000-s000000 (metadata final_state `smeta`, NULL: none) of samples "a" and "b" (4 tokens of
 * K x H rows, bf16 or fp8 with their scales); f/<id> of dtype fdt and [4, fw] for each id in
 * `fin`, fs/<id> F32 [4, 1] for each id in `fsc`; a NaN in f/a's token 0, column 5 with `nan`;
 * and the end of epoch 0. */
static void make_spool(const char *dir, const char *meta, const char *smeta, int fp8,
                       const char *fin, int32_t fdt, int64_t fw, const char *fsc, int nan) {
  ck_assert_int_eq(mkdir(dir, 0755), 0);
  char *p = df_path_join(dir, "spool.json");
  char *text = df_asprintf("{\"format\": \"dflash-spool-1\", \"num_layers\": %d, \"hidden_size\": "
                           "%d, \"dtype\": \"%s\"%s%s%s}\n",
                           K, H, fp8 ? "fp8_e4m3" : "bf16", meta ? ", \"final_state\": \"" : "",
                           meta ? meta : "", meta ? "\"" : "");
  ck_assert(df_test_write(p, text, strlen(text)));
  free(p), free(text);
  p = df_path_join(dir, "e00000.end");
  ck_assert(df_test_write(p, "shards=1 samples=2\n", 19));
  free(p);
  p = df_path_join(dir, "e00000-s000000.safetensors");
  dflash_safetensors_writer *sw;
  ck_assert_ok(dflash_safetensors_writer_create(p, &sw));
  char k[8], h[8];
  snprintf(k, sizeof k, "%d", K), snprintf(h, sizeof h, "%d", H);
  const char *keys[5] = {"format", "num_layers", "hidden_size", "dtype", "final_state"};
  const char *vals[5] = {"dflash-hidden-1", k, h, fp8 ? "fp8_e4m3" : "bf16", smeta};
  for (size_t i = 0; i < (smeta ? 5u : 4u); i++)
    ck_assert_ok(dflash_safetensors_writer_metadata(sw, keys[i], vals[i]));
  int64_t hs[2] = {4, K * H}, ss[2] = {4, K}, fs[2] = {4, fw}, fss[2] = {4, 1};
  int32_t hdt = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  const char *ids = "ab";
  char name[8];
  for (int pass = 0; pass < 2; pass++)
    for (const char *c = ids; *c; c++) {
      bool f_ = strchr(fin, *c) != NULL, s_ = strchr(fsc, *c) != NULL;
      if (!pass) {
        snprintf(name, sizeof name, "h/%c", *c);
        ck_assert_ok(dflash_safetensors_writer_declare(sw, name, hdt, 2, hs));
        snprintf(name, sizeof name, "s/%c", *c);
        if (fp8) ck_assert_ok(dflash_safetensors_writer_declare(sw, name, DFLASH_DTYPE_F32, 2, ss));
        snprintf(name, sizeof name, "f/%c", *c);
        if (f_) ck_assert_ok(dflash_safetensors_writer_declare(sw, name, fdt, 2, fs));
        snprintf(name, sizeof name, "fs/%c", *c);
        if (s_) ck_assert_ok(dflash_safetensors_writer_declare(sw, name, DFLASH_DTYPE_F32, 2, fss));
        continue;
      }
      uint16_t buf[4 * K * H];
      uint8_t codes[4 * K * H];
      float scales[4 * K];
      for (int i = 0; i < 4 * K * H; i++) {
        buf[i] = df_f32_to_bf16(val(i, 3));
        codes[i] = df_f32_to_e4m3(val(i, 3) * 100.0f);
      }
      for (int i = 0; i < 4 * K; i++) scales[i] = 0.01f;
      if (fp8) ck_assert_ok(dflash_safetensors_writer_write(sw, codes, sizeof codes));
      else ck_assert_ok(dflash_safetensors_writer_write(sw, buf, sizeof buf));
      if (fp8) ck_assert_ok(dflash_safetensors_writer_write(sw, scales, sizeof scales));
      if (f_) {
        if (nan && *c == 'a') buf[5] = 0x7fc0; /* bf16 NaN */
        ck_assert_ok(dflash_safetensors_writer_write(sw,
                                                     fdt == DFLASH_DTYPE_F8_E4M3 ? (void *)codes
                                                                                 : (void *)buf,
                                                     (size_t)(4 * fw) * dflash_dtype_size(fdt)));
      }
      if (s_) ck_assert_ok(dflash_safetensors_writer_write(sw, scales, 16));
    }
  ck_assert_ok(dflash_safetensors_writer_commit(sw));
  dflash_safetensors_writer_free(sw);
  free(p);
}

/* The first sample of the spool at `dir`: its status (the message in dflash_last_error), and
 * its final state's value at token 0, column 1 into *fin1 (NaN when it has none). */
static dflash_status first_sample(const char *dir, float *fin1) {
  dflash_spool_options so;
  dflash_spool_options_default(&so);
  so.wait_s = 0;
  dflash_spool *c;
  *fin1 = NAN;
  dflash_status st = dflash_spool_open(dir, &so, &c);
  if (st) return st;
  dflash_sample smp = {.struct_size = sizeof smp};
  int32_t end;
  st = dflash_spool_next(c, &smp, &end);
  if (!st) ck_assert_int_eq(end, 0);
  if (!st && smp.target_final) *fin1 = smp.target_final[1];
  dflash_spool_free(c);
  return st;
}

/* A spool whose shard holds the final state wrong, or whose spool.json and shard disagree:
 * each a clear status naming the shard (or spool.json) and the sample, at the shard's opening
 * (before any of its samples is given). */
START_TEST(spool_malformed_final_state_named) {
  char *root = df_test_tmpdir(), dir[4096];
  int n = 0;
  float fin1;
  const int32_t BF = DFLASH_DTYPE_BF16, F8 = DFLASH_DTYPE_F8_E4M3;
#define FRESH() (snprintf(dir, sizeof dir, "%s/s%d", root, n++), dir)
#define SHARD "e00000-s000000.safetensors"
  /* well formed, as a reference */
  make_spool(FRESH(), "post_norm", "post_norm", 0, "ab", BF, H, "", 0);
  ck_assert_ok(first_sample(dir, &fin1));
  ck_assert_float_eq(fin1, df_bf16_to_f32(df_f32_to_bf16(val(1, 3))));
  /* sample b without it */
  make_spool(FRESH(), "post_norm", "post_norm", 0, "a", BF, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   SHARD ": sample b has no final state (f/b), though the spool declares "
                         "final_state");
  ck_assert_str_contains(dflash_last_error(), dir);
  /* another dtype, another width */
  make_spool(FRESH(), "post_norm", "post_norm", 0, "ab", DFLASH_DTYPE_F32, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   SHARD ": final state of sample a is not BF16 [4, 8]");
  make_spool(FRESH(), "post_norm", "post_norm", 0, "ab", BF, H + 1, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   SHARD ": final state of sample a is not BF16 [4, 8]");
  /* fp8 without its scales, or with scales of another shape */
  make_spool(FRESH(), "post_norm", "post_norm", 1, "ab", F8, H, "a", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   SHARD ": final state of sample b lacks its scales (fs/b)");
  make_spool(FRESH(), "post_norm", "post_norm", 1, "ab", F8, H, "ab", 0);
  ck_assert_ok(first_sample(dir, &fin1)); /* whole: reads, codes times the scale */
  ck_assert_float_eq(fin1, df_e4m3_to_f32(df_f32_to_e4m3(val(1, 3) * 100.0f)) * 0.01f);
  /* spool.json and the shard disagree, either way; f/ tensors nobody declares */
  make_spool(FRESH(), "post_norm", NULL, 0, "ab", BF, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_MISMATCH,
                   SHARD ": the spool's spool.json declares final_state, but the shard does not");
  make_spool(FRESH(), NULL, "post_norm", 0, "ab", BF, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_MISMATCH,
                   SHARD ": the shard declares final_state = \"post_norm\", but the spool's "
                         "spool.json does not");
  make_spool(FRESH(), NULL, NULL, 0, "b", BF, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   SHARD ": final-state tensor f/b, but neither the shard nor spool.json declares "
                         "final_state");
  /* another convention in spool.json, or an unreadable one */
  make_spool(FRESH(), "pre_norm", "pre_norm", 0, "ab", BF, H, "", 0);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   "spool.json: final_state = \"pre_norm\": this libdflash reads \"post_norm\"");
  /* a NaN in the final state: named with the sample, token and column when it is read */
  make_spool(FRESH(), "post_norm", "post_norm", 0, "ab", BF, H, "", 1);
  ck_assert_status(first_sample(dir, &fin1), DFLASH_E_FORMAT,
                   "sample a: target final state at token 0, column 5 is not finite");
  ck_assert_str_contains(dflash_last_error(), dir);
#undef FRESH
#undef SHARD
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* A spool shard cut short inside its last sample's final state (a copy cut short, a disk
 * error): DFLASH_E_TRUNCATED naming the shard and the tensor (so the sample), bf16 and fp8
 * (whose last tensor is the scales). The samples of the shards before it are given. */
START_TEST(spool_truncated_final_state_named) {
  for (int fp8 = 0; fp8 < 2; fp8++) {
    char *root = df_test_tmpdir(), *sp = df_path_join(root, "spool");
    dflash_hidden_writer_options o;
    dflash_hidden_writer_options_default(&o);
    o.final_state = 1, o.dtype = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
    o.shard_bytes = 1 << 12, o.spool_budget = 1 << 20;
    dflash_hidden_writer *w;
    ck_assert_ok(dflash_hidden_writer_create(sp, K, H, &o, &w));
    float *x = rows(4, K * H, 0), *f = rows(4, H, 1);
    ck_assert_ok(add(w, "a", x, f, 4));
    ck_assert_ok(dflash_hidden_writer_flush(w)); /* shard 0: a */
    ck_assert_ok(add(w, "b", x, f, 4));
    ck_assert_ok(add(w, "c", x, f, 4));
    ck_assert_ok(dflash_hidden_writer_end_epoch(w)); /* shard 1: b, c */
    dflash_hidden_writer_free(w);
    char *shard = spool_file(sp, "e00000-s000001.safetensors");
    struct stat sb;
    ck_assert_int_eq(stat(shard, &sb), 0);
    ck_assert_int_eq(truncate(shard, sb.st_size - 6), 0);
    dflash_spool_options so;
    dflash_spool_options_default(&so);
    so.wait_s = 0;
    dflash_spool *c;
    ck_assert_ok(dflash_spool_open(sp, &so, &c));
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t end;
    ck_assert_ok(dflash_spool_next(c, &smp, &end));
    ck_assert_str_eq(smp.id, "a");
    ck_assert_ptr_nonnull(smp.target_final);
    ck_assert_status(dflash_spool_next(c, &smp, &end), DFLASH_E_TRUNCATED,
                     "e00000-s000001.safetensors");
    ck_assert_str_contains(dflash_last_error(), fp8 ? "tensor \"fs/c\"" : "tensor \"f/c\"");
    dflash_spool_free(c);
    free(x), free(f), free(shard), free(sp);
    df_test_rmtree(root);
    free(root);
  }
}
END_TEST

Suite *df_test_suite(void) {
  Suite *s = suite_create("hidden-final");
  TCase *tc = tcase_create("final_state");
  tcase_add_test(tc, final_state_round_trip);
  tcase_add_test(tc, final_state_writer_refusals);
  tcase_add_test(tc, old_store_reads_without_final_state);
  tcase_add_test(tc, malformed_final_state_named);
  tcase_add_test(tc, fp8_final_state_without_scales_named);
  tcase_add_test(tc, stream_gives_target_final);
  tcase_add_test(tc, spool_final_state_round_trip);
  tcase_add_test(tc, spool_without_final_state_and_refusals);
  tcase_add_test(tc, spool_malformed_final_state_named);
  tcase_add_test(tc, spool_truncated_final_state_named);
  suite_add_tcase(s, tc);
  return s;
}
