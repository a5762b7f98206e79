/* Synthetic worlds and rank processes for the training-run tests (synth.h). */
#include "synth.h"

#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/safetensors.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

enum { V = 17, H = 32, NCODES = 4 };

static uint64_t next(uint64_t *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return *s >> 33;
}

static float uniform(uint64_t *s) { return (float)(next(s) % 20001) / 10000.0f - 1.0f; }

char *synth_path(const char *a, const char *b) {
  char *p = malloc(strlen(a) + strlen(b) + 2);
  ck_assert_ptr_nonnull(p);
  sprintf(p, "%s/%s", a, b);
  return p;
}

/* Token chains x[t+1] = perm_c[x[t]]; hidden states carry the code c. */
static void write_samples(const char *root, int n, int S, uint64_t *rng) {
  int perm[NCODES][16];
  float code[NCODES][H];
  for (int c = 0; c < NCODES; c++) {
    for (int i = 0; i < 16; i++) perm[c][i] = i;
    for (int i = 15; i > 0; i--) {
      int j = (int)(next(rng) % (uint64_t)(i + 1)), t = perm[c][i];
      perm[c][i] = perm[c][j], perm[c][j] = t;
    }
    for (int k = 0; k < H; k++) code[c][k] = uniform(rng);
  }
  char *data = synth_path(root, "train"), *hid = synth_path(root, "hidden");
  dflash_dataset_writer *dw;
  dflash_hidden_writer *hw;
  ck_assert_ok(dflash_dataset_writer_create(data, NULL, &dw));
  ck_assert_ok(dflash_hidden_writer_create(hid, 1, H, NULL, &hw));
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)S);
  uint8_t *mask = malloc((size_t)S);
  float *h = malloc(sizeof(float) * (size_t)S * H);
  for (int i = 0; i < n; i++) {
    int c = (int)(next(rng) % NCODES);
    ids[0] = (int32_t)(next(rng) % 16);
    for (int t = 1; t < S; t++) ids[t] = perm[c][ids[t - 1]];
    memset(mask, 1, (size_t)S);
    for (int t = 0; t < S; t++)
      for (int k = 0; k < H; k++) h[(size_t)t * H + k] = code[c][k] + 0.1f * uniform(rng);
    char id[32];
    snprintf(id, sizeof id, "s%03d", i);
    ck_assert_ok(dflash_dataset_writer_add(dw, id, ids, mask, (size_t)S));
    ck_assert_ok(df_test_hidden_add(hw, id, h, NULL, S));
  }
  ck_assert_ok(dflash_dataset_writer_commit(dw));
  ck_assert_ok(dflash_hidden_writer_commit(hw));
  dflash_dataset_writer_free(dw);
  dflash_hidden_writer_free(hw);
  free(ids), free(mask), free(h), free(data), free(hid);
}

static void write_target(const char *root, uint64_t *rng) {
  char *dir = synth_path(root, "target");
  ck_assert_int_eq(mkdir(dir, 0755), 0);
  char *path = synth_path(dir, "model.safetensors");
  float *w = malloc(sizeof(float) * V * H);
  dflash_safetensors_writer *sw;
  int64_t shape[2] = {V, H};
  ck_assert_ok(dflash_safetensors_writer_create(path, &sw));
  ck_assert_ok(dflash_safetensors_writer_declare(sw, "model.embed_tokens.weight", DFLASH_DTYPE_F32,
                                                 2, shape));
  ck_assert_ok(dflash_safetensors_writer_declare(sw, "lm_head.weight", DFLASH_DTYPE_F32, 2, shape));
  for (int t = 0; t < 2; t++) {
    for (int i = 0; i < V * H; i++) w[i] = uniform(rng);
    ck_assert_ok(dflash_safetensors_writer_write(sw, w, sizeof(float) * V * H));
  }
  ck_assert_ok(dflash_safetensors_writer_commit(sw));
  dflash_safetensors_writer_free(sw);
  free(w), free(path), free(dir);
}

void synth_world(const char *root, int n_samples, int seq_len, uint64_t seed) {
  uint64_t rng = seed * 0x9e3779b97f4a7c15ULL + 1;
  write_samples(root, n_samples, seq_len, &rng);
  write_target(root, &rng);
  static const char cfg[] =
      "{\"architectures\": [\"DFlashDraftModel\"], \"hidden_size\": 32, \"intermediate_size\": "
      "64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
      "\"head_dim\": 8, \"vocab_size\": 17, \"num_target_layers\": 8, \"block_size\": 4, "
      "\"dflash_config\": {\"mask_token_id\": 16, \"target_layer_ids\": [3]}}";
  char *path = synth_path(root, "drafter.json");
  ck_assert(df_test_write(path, cfg, sizeof cfg - 1));
  free(path);
}

/* Paths that live as long as the test process (still reachable: not leaks). */
static char *kept(char *p) {
  static char **all;
  static size_t n;
  all = realloc(all, sizeof *all * (n + 1));
  ck_assert_ptr_nonnull(all);
  return all[n++] = p;
}

char *synth_at(const char *dir, const char *name) { return kept(synth_path(dir, name)); }

void synth_run_options(dflash_train_run_options *o, const char *root, const char *out) {
  dflash_train_run_options_default(o);
  o->config_path = kept(synth_path(root, "drafter.json"));
  o->target_path = kept(synth_path(root, "target"));
  o->data_dir = kept(synth_path(root, "train"));
  o->hidden_dir = kept(synth_path(root, "hidden"));
  o->out_dir = out;
  /* Its own trainer options, kept like the paths (synth_trainer gives them back to change). */
  dflash_trainer_options *t = malloc(sizeof *t);
  ck_assert_ptr_nonnull(t);
  kept((char *)t);
  dflash_trainer_options_default(t);
  t->n_threads = 1;
  t->num_anchors = 8;
  t->seed = 5;
  t->lr = 5e-3;
  o->trainer = t;
}

char *synth_small_run(dflash_train_run_options *o, char **out) {
  char *root = df_test_tmpdir();
  *out = synth_at(root, "out");
  synth_world(root, 8, 16, 3);
  synth_run_options(o, root, *out);
  o->epochs = 1, o->save_every_s = 0;
  return root;
}

dflash_trainer_options *synth_trainer(dflash_train_run_options *o) {
  return (dflash_trainer_options *)o->trainer; /* synth_run_options allocated it */
}

int synth_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  ck_assert(fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof a) &&
            !getsockname(fd, (struct sockaddr *)&a, &len));
  close(fd);
  return ntohs(a.sin_port);
}

static void set_env(const char *name, long v) {
  char s[32];
  snprintf(s, sizeof s, "%ld", v);
  setenv(name, s, 1);
}

pid_t synth_spawn(const dflash_train_run_options *o, int rank, int world, int port,
                  double timeout_s, const char *report) {
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid > 0) return pid;
  static const char *const vars[] = {"RANK",         "WORLD_SIZE",   "LOCAL_RANK",
                                     "MASTER_ADDR",  "MASTER_PORT",  "SLURM_PROCID",
                                     "SLURM_NTASKS", "SLURM_LOCALID"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
  if (world > 1) {
    set_env("RANK", rank);
    set_env("WORLD_SIZE", world);
    set_env("MASTER_PORT", port);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
  }
  /* The timeout is a trainer option: this process's copies (it exits after the run). */
  dflash_train_run_options oo = *o;
  dflash_trainer_options to;
  if (o->trainer) to = *o->trainer;
  else dflash_trainer_options_default(&to);
  if (timeout_s > 0) to.dist_timeout_s = timeout_s;
  oo.trainer = &to;
  dflash_status st = dflash_train_run(&oo, NULL);
  FILE *f = fopen(report, "w");
  if (f) {
    fprintf(f, "%d\n%s\n", (int)st, st ? dflash_last_error() : "");
    fclose(f);
  }
  _exit((int)st);
}

int synth_wait(pid_t pid, double limit_s) {
  struct timespec t0, now, nap = {0, 10 * 1000 * 1000};
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int status;
    pid_t got = waitpid(pid, &status, WNOHANG);
    ck_assert_int_ge(got, 0);
    if (got == pid) {
      ck_assert_msg(WIFEXITED(status), "process %d ended by signal %d", (int)pid,
                    WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      return WEXITSTATUS(status);
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec - t0.tv_sec + (now.tv_nsec - t0.tv_nsec) * 1e-9 > limit_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ck_abort_msg("process %d still running after %.0f s: it hangs", (int)pid, limit_s);
    }
    nanosleep(&nap, NULL);
  }
}

int synth_report(const char *report, char *msg, size_t cap) {
  FILE *f = fopen(report, "r");
  ck_assert_msg(f != NULL, "no report %s", report);
  int st = -1;
  ck_assert_int_eq(fscanf(f, "%d\n", &st), 1);
  if (!fgets(msg, (int)cap, f)) msg[0] = 0;
  fclose(f);
  return st;
}

char **synth_lines(const char *path, size_t *n) {
  *n = 0;
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  char **lines = NULL, buf[1024];
  while (fgets(buf, sizeof buf, f)) {
    lines = realloc(lines, sizeof *lines * (*n + 1));
    lines[(*n)++] = strdup(buf);
  }
  fclose(f);
  return lines;
}

void synth_free_lines(char **lines, size_t n) {
  for (size_t i = 0; i < n; i++) free(lines[i]);
  free(lines);
}

float *synth_checkpoint_floats(const char *dir, size_t *n) {
  char *path = synth_path(dir, "model.safetensors");
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(path, &st));
  size_t count = dflash_safetensors_count(st), total = 0;
  float *out = NULL;
  for (size_t i = 0; i < count; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_safetensors_get(st, i, &t));
    ck_assert_int_eq(t.dtype, DFLASH_DTYPE_F32);
    size_t k = (size_t)t.nbytes / sizeof(float);
    out = realloc(out, sizeof(float) * (total + k));
    memcpy(out + total, t.data, (size_t)t.nbytes);
    total += k;
  }
  dflash_safetensors_free(st);
  free(path);
  *n = total;
  return out;
}

bool synth_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

size_t synth_metrics(const char *dir, synth_metric *m, size_t cap) {
  char *p = synth_path(dir, "metrics.jsonl");
  size_t n;
  char **lines = synth_lines(p, &n);
  ck_assert_msg(lines != NULL, "%s is missing", p);
  ck_assert_uint_le(n, cap);
  for (size_t i = 0; i < n; i++)
    ck_assert_int_eq(sscanf(lines[i],
                            "{\"step\": %ld, \"epoch\": %d, \"loss\": %lf, "
                            "\"grad_norm\": %lf, \"lr\": %lf, \"tokens\": %ld",
                            &m[i].step, &m[i].epoch, &m[i].loss, &m[i].norm, &m[i].lr,
                            &m[i].tokens),
                     6);
  synth_free_lines(lines, n);
  free(p);
  return n;
}

double synth_max_abs_diff(const char *dir_a, const char *dir_b) {
  size_t na, nb;
  float *x = synth_checkpoint_floats(dir_a, &na), *y = synth_checkpoint_floats(dir_b, &nb);
  ck_assert_uint_eq(na, nb);
  double worst = 0;
  for (size_t i = 0; i < na; i++) {
    double d = x[i] > y[i] ? x[i] - y[i] : y[i] - x[i];
    worst = d > worst ? d : worst;
  }
  free(x), free(y);
  return worst;
}
