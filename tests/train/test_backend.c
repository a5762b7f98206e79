/* Host logic of the CUDA backend that needs no GPU: the memory plan, the
 * no-device errors, rank discovery, the TCP rendezvous, gradient buckets. */
#include <dflash/train.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"
#include "train/backend.h"
#include "train/cuda/dfcuda.h"
#include "train/cuda/dist.h"

/* The Kimi K2.5/K2.6 drafter (spec table). */
static void kimi(dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->hidden_size = 7168;
  c->intermediate_size = 18432;
  c->num_hidden_layers = 6;
  c->num_attention_heads = 64;
  c->num_key_value_heads = 8;
  c->head_dim = 128;
  c->vocab_size = 163840;
  c->num_target_layers = 61;
  c->block_size = 16;
  c->mask_token_id = 163838;
  c->n_target_layer_ids = 6;
  int32_t ids[6] = {1, 12, 24, 35, 47, 58};
  memcpy(c->target_layer_ids, ids, sizeof ids);
}

/*
 * Hand arithmetic (H 7168, I 18432, qd = 64*128 = 8192, kd = 8*128 = 1024):
 *   layer  = 2H + 2*qd*H + 2*kd*H + 2*128 + 3*I*H = 528,496,896
 *   params = H*6H + H + 6*layer + H               = 3,479,277,056
 * Activations for seq 3072, 512 anchors (T = 8192 block rows, R = 7680
 * supervised rows, Sc = 3072), vocab chunk 8192, summed tensor by tensor
 * (every size here is a multiple of the 256-byte alignment):
 *   per layer, T rows: bf16 4H + 3qd + 3kd + 3I, f32 2 + 2*64 + 8; Sc rows:
 *   bf16 3kd, f32 8                                     = 1,852,211,200
 *   once: hidden 2*Sc*6H, context 2x bf16 + f32 rstd, h_out/hf, backward
 *   scratch (dh bf16, dx f32, dq, dkb, dvb, datt, dg, du, dm, dtmp, D f32,
 *   dkc, dvc, dctx f32, dctx_tmp), CE rows (x, dx bf16, acc f32, logits
 *   f32 R x 8192, probs bf16, 5 f32 + 2 i32 per row), tokens, anchors
 *                                                       = 3,246,718,976
 *   arena = 3,246,718,976 + 6 * 1,852,211,200           = 14,359,986,176
 * plus what the backend keeps beside the arena: staging 4 * 2^26, RoPE
 * frequencies 8 * 64, norm scratch 4 * 256 * 7168, reduction partials
 * 8 * 5120, cos/sin + positions for 3072 + 16 positions (3088 * 516)
 *                                                       =    277,410,368
 * and the per-sequence path: results 8 * (2 * 1024 + 1), position weights
 * 4 * 16, two stages of 3088 context rows at fp32's 4 B (2 * (4 * 3088 *
 * 6H + 256))                                            =  1,062,486,600
 * and the step's clip state (norm, factor; df_cu_clip)  =             32
 *   activations                                         = 15,699,883,176
 * (P is a multiple of 8 in every bucket: no padding.)
 */
START_TEST(plan_kimi_on_8x80gb) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  kimi(&c);
  ck_assert_ok(dflash_drafter_config_validate(&c));
  dflash_train_plan_options o;
  dflash_train_plan_options_default(&o);
  o.world_size = 8;
  dflash_train_plan p = {.struct_size = sizeof p};
  ck_assert_ok(dflash_train_plan_compute(&c, &o, &p));
  ck_assert_uint_eq(p.n_params, 3479277056ULL);
  ck_assert_uint_eq(p.weights, 6958554112ULL);
  ck_assert_uint_eq(p.grads, 13917108224ULL);
  ck_assert_uint_eq(p.masters, 1739638528ULL); /* 4 * P / 8 */
  ck_assert_uint_eq(p.moments, 3479277056ULL); /* 8 * P / 8 */
  ck_assert_uint_eq(p.frozen, 4697620480ULL);  /* 2 * 2 * 163840 * 7168 */
  ck_assert_uint_eq(p.activations, 15699883176ULL);
  ck_assert_uint_eq(p.reserve, 4ULL << 30);
  ck_assert_uint_eq(p.total, 50787048872ULL);
  ck_assert_uint_le(p.total, 80000000000ULL);
}
END_TEST

/* With Muon the plan adds the step's workspace (cuda/arena.cu alloc_muon): the largest Muon
 * matrix twice, fc [7168, 6 x 7168] = 308,281,344 elements (the MLP's [18432, 7168] is
 * 132,120,576), and the largest Gram matrix twice, 7168^2 = 51,380,224 (fc, q, o, gate, up,
 * down all have 7168 as the smaller side), fp32, plus one double:
 * 4 * (2 * 308,281,344 + 2 * 51,380,224) + 8 = 2,877,292,552 (bench/gpu_model.py kimi
 * --optimizer muon: "Muon workspace 2.68" GiB). Nothing else moves; an unknown optimizer
 * is refused. */
START_TEST(plan_counts_muon_workspace) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  kimi(&c);
  dflash_train_plan_options o;
  dflash_train_plan_options_default(&o);
  ck_assert_int_eq(o.optimizer, DFLASH_OPTIMIZER_ADAMW);
  o.world_size = 8;
  dflash_train_plan a = {.struct_size = sizeof a}, m = {.struct_size = sizeof m};
  ck_assert_ok(dflash_train_plan_compute(&c, &o, &a));
  o.optimizer = DFLASH_OPTIMIZER_MUON;
  ck_assert_ok(dflash_train_plan_compute(&c, &o, &m));
  ck_assert_uint_eq(m.activations - a.activations, 2877292552ULL);
  ck_assert_uint_eq(m.total - a.total, 2877292552ULL);
  ck_assert_uint_eq(m.moments, a.moments); /* the CUDA backend keeps both moment buffers */
  o.optimizer = 2;
  ck_assert_status(dflash_train_plan_compute(&c, &o, &m), DFLASH_E_INVALID_ARG, "optimizer 2");
}
END_TEST

START_TEST(plan_refuses_one_gpu_naming_the_term) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  kimi(&c);
  dflash_train_plan_options o;
  dflash_train_plan_options_default(&o);
  dflash_train_plan p = {.struct_size = sizeof p};
  /* Without sharding: 2P + 4P + 8P + 4P + the rest = 87,319,457,960 bytes. */
  ck_assert_status(dflash_train_plan_compute(&c, &o, &p), DFLASH_E_NOMEM, "AdamW moments");
  ck_assert_uint_eq(p.total, 87319457960ULL);
  ck_assert_uint_eq(p.moments, 8ULL * 3479277056ULL);
  /* 512 anchors over 12288 tokens: activations become the largest term. */
  o.world_size = 8;
  o.num_anchors = 4096;
  o.seq_len = 12288;
  ck_assert_status(dflash_train_plan_compute(&c, &o, &p), DFLASH_E_NOMEM, "activations");
  o.struct_size = 3;
  ck_assert_status(dflash_train_plan_compute(&c, &o, &p), DFLASH_E_INVALID_ARG, "struct_size");
}
END_TEST

/* Without a device (CI) the CUDA backend fails cleanly, never crashes. */
START_TEST(cuda_backend_without_device) {
  int n = 0;
  dflash_status dev = dflash_cuda_device_count(&n);
  if (dev == DFLASH_OK && n > 0) return; /* a GPU machine: tests/gpu covers it */
  static const char *cfg_json =
      "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 1,"
      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4,"
      "\"vocab_size\": 31, \"num_target_layers\": 8, \"block_size\": 4,"
      "\"dflash_config\": {\"mask_token_id\": 30, \"target_layer_ids\": [1, 5]}}";
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(cfg_json, strlen(cfg_json), "cfg", &cfg));
  float *E = calloc(31 * 16, sizeof *E);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  dflash_trainer *t = (dflash_trainer *)1;
#ifdef DFLASH_HAVE_CUDA
  ck_assert_status(dflash_trainer_create(&cfg, E, E, &o, &t), DFLASH_E_NO_DEVICE, "cuda");
#else
  ck_assert_status(dflash_trainer_create(&cfg, E, E, &o, &t), DFLASH_E_UNSUPPORTED, "without CUDA");
#endif
  ck_assert_ptr_null(t);
  free(E);
}
END_TEST

/* partial_rotary_factor is no reason for the CUDA backend to refuse a config
 * (its RoPE kernel rotates the first rot dims); without CUDA the backend is
 * refused as such, and with CUDA but no GPU the device lookup fails. */
START_TEST(cuda_backend_takes_partial_rotary) {
  static const char *cfg_json =
      "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 1,"
      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4,"
      "\"vocab_size\": 31, \"num_target_layers\": 8, \"block_size\": 4,"
      "\"partial_rotary_factor\": 0.5,"
      "\"dflash_config\": {\"mask_token_id\": 30, \"target_layer_ids\": [1, 5]}}";
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(cfg_json, strlen(cfg_json), "cfg", &cfg));
  float *E = calloc(31 * 16, sizeof *E);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  dflash_trainer *t = (dflash_trainer *)1;
#ifdef DFLASH_HAVE_CUDA
  dflash_status st = dflash_trainer_create(&cfg, E, E, &o, &t);
  ck_assert_msg(st == DFLASH_OK || st == DFLASH_E_NO_DEVICE, "%s: %s", dflash_status_str(st),
                dflash_last_error());
  dflash_trainer_free(st ? NULL : t);
  if (!st) t = NULL;
#else
  ck_assert_status(dflash_trainer_create(&cfg, E, E, &o, &t), DFLASH_E_UNSUPPORTED, "without CUDA");
#endif
  ck_assert_ptr_null(t);
  o.backend = DFLASH_BACKEND_CPU;
  ck_assert_ok(dflash_trainer_create(&cfg, E, E, &o, &t));
  dflash_trainer_free(t);
  free(E);
}
END_TEST

/* ---- rank discovery -------------------------------------------------------- */

typedef struct env_table {
  const char *kv[16];
} env_table;

static const char *table_get(void *ctx, const char *name) {
  env_table *t = ctx;
  for (int i = 0; t->kv[i]; i += 2)
    if (!strcmp(t->kv[i], name)) return t->kv[i + 1];
  return NULL;
}

START_TEST(dist_env_torchrun_slurm_and_errors) {
  df_dist_env e;
  env_table none = {{NULL}};
  ck_assert_ok(df_dist_env_parse(table_get, &none, &e));
  ck_assert_int_eq(e.world, 1);
  ck_assert_int_eq(e.rank, 0);
  env_table torchrun = {{"RANK", "5", "WORLD_SIZE", "16", "LOCAL_RANK", "1", "MASTER_ADDR", "node0",
                         "MASTER_PORT", "29500", NULL}};
  ck_assert_ok(df_dist_env_parse(table_get, &torchrun, &e));
  ck_assert_int_eq(e.rank, 5);
  ck_assert_int_eq(e.world, 16);
  ck_assert_int_eq(e.local_rank, 1);
  ck_assert_str_eq(e.master_addr, "node0");
  ck_assert_int_eq(e.master_port, 29500);
  env_table slurm = {{"SLURM_PROCID", "3", "SLURM_NTASKS", "4", "SLURM_LOCALID", "3", "MASTER_ADDR",
                      "10.0.0.1", "MASTER_PORT", "1234", NULL}};
  ck_assert_ok(df_dist_env_parse(table_get, &slurm, &e));
  ck_assert_int_eq(e.rank, 3);
  ck_assert_int_eq(e.world, 4);
  ck_assert_int_eq(e.local_rank, 3);
  env_table no_addr = {{"RANK", "0", "WORLD_SIZE", "2", "MASTER_PORT", "1", NULL}};
  ck_assert_status(df_dist_env_parse(table_get, &no_addr, &e), DFLASH_E_CONFIG, "MASTER_ADDR");
  env_table bad = {{"RANK", "2", "WORLD_SIZE", "2", "MASTER_ADDR", "a", "MASTER_PORT", "1", NULL}};
  ck_assert_status(df_dist_env_parse(table_get, &bad, &e), DFLASH_E_CONFIG, "not below");
  env_table junk = {{"RANK", "x1", "WORLD_SIZE", "2", NULL}};
  ck_assert_status(df_dist_env_parse(table_get, &junk, &e), DFLASH_E_CONFIG, "RANK=\"x1\"");
  env_table half = {{"RANK", "0", NULL}};
  ck_assert_status(df_dist_env_parse(table_get, &half, &e), DFLASH_E_CONFIG, "WORLD_SIZE");
  env_table port = {{"MASTER_PORT", "70000", NULL}};
  ck_assert_status(df_dist_env_parse(table_get, &port, &e), DFLASH_E_CONFIG, "MASTER_PORT");
}
END_TEST

/* ---- rendezvous over localhost with one thread per rank -------------------- */

enum { WORLD = 4, BLOB = 128 };

typedef struct rank_arg {
  df_dist_env env;
  unsigned char blob[BLOB];
  dflash_status st;
} rank_arg;

static void *rank_main(void *p) {
  rank_arg *a = p;
  a->st = df_rendezvous(&a->env, a->blob, BLOB, 20.0);
  return NULL;
}

START_TEST(rendezvous_hands_rank0_blob_to_all) {
  rank_arg r[WORLD];
  pthread_t th[WORLD];
  int port = synth_free_port();
  for (int i = 0; i < WORLD; i++) {
    memset(&r[i], 0, sizeof r[i]);
    r[i].env = (df_dist_env){.rank = i, .world = WORLD, .master_port = port};
    strcpy(r[i].env.master_addr, "127.0.0.1");
    for (int k = 0; k < BLOB; k++) r[i].blob[k] = i == 0 ? (unsigned char)(k * 7 + 1) : 0;
  }
  /* Others first: they must retry until rank 0 listens. */
  for (int i = WORLD - 1; i >= 0; i--) pthread_create(&th[i], NULL, rank_main, &r[i]);
  for (int i = 0; i < WORLD; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < WORLD; i++) {
    ck_assert_msg(r[i].st == DFLASH_OK, "rank %d: %s", i, dflash_last_error());
    ck_assert_mem_eq(r[i].blob, r[0].blob, BLOB);
  }
  ck_assert_int_eq(r[2].blob[3], 22);
}
END_TEST

START_TEST(rendezvous_times_out_naming_missing_ranks) {
  df_dist_env e = {.rank = 0, .world = 3, .master_port = synth_free_port()};
  strcpy(e.master_addr, "127.0.0.1");
  unsigned char blob[8] = {0};
  ck_assert_status(df_rendezvous(&e, blob, sizeof blob, 0.2), DFLASH_E_TIMEOUT, "1 of 3");
}
END_TEST

/* ---- buckets ---------------------------------------------------------------- */

START_TEST(buckets_cover_the_buffer_and_shard_it) {
  df_bucket_layout l;
  ck_assert_ok(df_bucket_layout_init(&l, 1003, 4, 300));
  ck_assert_uint_eq(l.n_padded, 1004);
  ck_assert_uint_eq(l.shard_len, 251);
  /* 300 per bucket from the end: [704,1004) [404,704) [104,404) [0,104). */
  ck_assert_uint_eq(l.n_buckets, 4);
  size_t expect_off[] = {704, 404, 104, 0}, expect_cnt[] = {300, 300, 300, 104};
  size_t shard = 0;
  for (size_t b = 0; b < l.n_buckets; b++) {
    ck_assert_uint_eq(l.buckets[b].offset, expect_off[b]);
    ck_assert_uint_eq(l.buckets[b].count, expect_cnt[b]);
    ck_assert_uint_eq(l.buckets[b].count % 4, 0);
    ck_assert_uint_eq(l.buckets[b].shard_offset, shard);
    shard += l.buckets[b].count / 4;
  }
  ck_assert_uint_eq(shard, l.shard_len);
  df_bucket_layout_free(&l);
  /* A bucket size below the world size still makes progress. */
  ck_assert_ok(df_bucket_layout_init(&l, 10, 8, 3));
  ck_assert_uint_eq(l.n_padded, 16);
  ck_assert_uint_eq(l.n_buckets, 2);
  df_bucket_layout_free(&l);
  ck_assert_status(df_bucket_layout_init(&l, 0, 8, 3), DFLASH_E_INVALID_ARG, "0 elements");
}
END_TEST

/* Two environments for df_link_note: nothing set, and a PCIe box tuned as docs/gpu.md says. */
static const char *env_none(const char *name) {
  (void)name;
  return NULL;
}
static const char *env_tuned(const char *name) {
  if (!strcmp(name, "NCCL_P2P_LEVEL")) return "SYS";
  if (!strcmp(name, "NCCL_MIN_NCHANNELS")) return "8";
  return NULL;
}

/* The start-up line names device, P2P, NCCL and its settings, and says what a PCIe box with
 * several ranks lacks: a peer without P2P, NCCL_MIN_NCHANNELS < 8, no NCCL_P2P_LEVEL; an
 * NVLink box or one rank gets no advice. */
START_TEST(link_note_flags_a_mistuned_pcie_box) {
  df_cu_props rtx = {.name = "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                     .major = 12,
                     .n_devices = 8,
                     .p2p_peers = 6,
                     .p2p_missing = 5,
                     .nccl_version = 22703};
  char out[1536];
  df_link_note(&rtx, 2, 8, env_none, out, sizeof out);
  printf("%s\n", out);
  ck_assert_msg(strstr(out, "device 2 of 8: NVIDIA RTX PRO 6000") && strstr(out, "sm_120") &&
                    strstr(out, "PCIe, no NVLink") && strstr(out, "P2P to 6 of 7") &&
                    strstr(out, "NCCL 2.27.3") && strstr(out, "NCCL_P2P_LEVEL=(unset)"),
                "%s", out);
  ck_assert_msg(strstr(out, "no P2P to device 5") && strstr(out, "NCCL_MIN_NCHANNELS=8 (") &&
                    strstr(out, "NCCL_P2P_LEVEL=SYS ("),
                "%s", out);
  rtx.p2p_peers = 7, rtx.p2p_missing = -1;
  df_link_note(&rtx, 0, 8, env_tuned, out, sizeof out);
  ck_assert_msg(strstr(out, "NCCL_MIN_NCHANNELS=8,") || strstr(out, "NCCL_MIN_NCHANNELS=8 "), "%s",
                out);
  ck_assert_msg(!strstr(out, "check:") && strstr(out, "settings of docs/gpu.md are in effect"),
                "%s", out);
  df_link_note(&rtx, 0, 1, env_none, out, sizeof out); /* one rank: nothing to advise */
  ck_assert_msg(!strstr(out, "check:"), "%s", out);
  df_cu_props h200 = {.name = "NVIDIA H200",
                      .major = 9,
                      .n_devices = 8,
                      .p2p_peers = 7,
                      .p2p_missing = -1,
                      .nccl_version = -1};
  df_link_note(&h200, 0, 8, env_none, out, sizeof out);
  ck_assert_msg(strstr(out, "NVLink") && strstr(out, "NCCL not built in") && !strstr(out, "check:"),
                "%s", out);
  char tiny[24]; /* cut, still a string */
  df_link_note(&rtx, 0, 8, env_none, tiny, sizeof tiny);
  ck_assert_uint_eq(strlen(tiny), sizeof tiny - 1);
}
END_TEST

TCase *tc_backend(void) {
  TCase *tc = tcase_create("backend");
  tcase_add_test(tc, plan_kimi_on_8x80gb);
  tcase_add_test(tc, link_note_flags_a_mistuned_pcie_box);
  tcase_add_test(tc, plan_refuses_one_gpu_naming_the_term);
  tcase_add_test(tc, plan_counts_muon_workspace);
  tcase_add_test(tc, cuda_backend_without_device);
  tcase_add_test(tc, cuda_backend_takes_partial_rotary);
  tcase_add_test(tc, dist_env_torchrun_slurm_and_errors);
  tcase_add_test(tc, rendezvous_hands_rank0_blob_to_all);
  tcase_add_test(tc, rendezvous_times_out_naming_missing_ranks);
  tcase_add_test(tc, buckets_cover_the_buffer_and_shard_it);
  return tc;
}
