/*
 * Test helpers for whole training runs: a tiny synthetic world (dataset,
 * hidden-state store, target head, drafter config) and training runs as
 * separate processes, one per rank, as torchrun would start them.
 */
#ifndef DFLASH_TESTS_TRAIN_SYNTH_H
#define DFLASH_TESTS_TRAIN_SYNTH_H

#include <dflash/train.h>
#include <stdbool.h>
#include <sys/types.h>

/*
 * In `root`: train/ (n_samples token chains of seq_len tokens, vocabulary
 * 17, every token supervised), hidden/ (one target layer, H = 32: the
 * chain's code plus noise), target/model.safetensors, drafter.json (1
 * layer, block 4). Everything follows from `seed`.
 */
void synth_world(const char *root, int n_samples, int seq_len, uint64_t seed);

/* Run options over synth_world(root) writing to `out` (1 thread, 8 anchors). */
void synth_run_options(dflash_train_run_options *o, const char *root, const char *out);
/* A fresh temporary root with synth_world(root, 8, 16, 3) and one epoch's run options into
 * root/out, no time-based saves: the run-level tests' starting point. *out: that folder. */
char *synth_small_run(dflash_train_run_options *o, char **out);
/* The trainer options synth_run_options gave `o` (its own, to change). */
dflash_trainer_options *synth_trainer(dflash_train_run_options *o);

/* A TCP port the kernel just handed out. */
int synth_free_port(void);

/*
 * Fork a process that runs dflash_train_run(o) as `rank` of `world` (world
 * 1: no rank variables at all) with MASTER_ADDR 127.0.0.1:port and
 * the trainer option dist_timeout_s = timeout_s (0: as `o` has it). It writes its status and
 * dflash_last_error() to `report` and exits with the status.
 */
pid_t synth_spawn(const dflash_train_run_options *o, int rank, int world, int port,
                  double timeout_s, const char *report);

/* Wait for `pid` for at most `limit_s` seconds (a hang kills it and fails
 * the test); returns its exit status. */
int synth_wait(pid_t pid, double limit_s);

/* The report a process wrote: status, and its message into msg. */
int synth_report(const char *report, char *msg, size_t cap);

/* Lines of a text file (NULL when absent); free with synth_free_lines. */
char **synth_lines(const char *path, size_t *n);
void synth_free_lines(char **lines, size_t n);

/* All parameters of a checkpoint's model.safetensors, in file order. */
float *synth_checkpoint_floats(const char *dir, size_t *n);

bool synth_exists(const char *path);

/* "a/b", malloc'd. */
char *synth_path(const char *a, const char *b);
/* The same, kept until the process exits (for paths in run options). */
char *synth_at(const char *dir, const char *name);

/* One line of metrics.jsonl. */
typedef struct synth_metric {
  long step, tokens;
  int epoch;
  double loss, norm, lr;
} synth_metric;

/* Read dir/metrics.jsonl (at most cap lines); returns the line count. */
size_t synth_metrics(const char *dir, synth_metric *m, size_t cap);

/* Largest |a - b| over the parameters of two checkpoints. */
double synth_max_abs_diff(const char *dir_a, const char *dir_b);

#endif
