/* The fault-injection loop (fault_loop.c) and the scenarios it runs (scenarios.c). */
#ifndef DFLASH_TESTS_FAULT_LOOP_H
#define DFLASH_TESTS_FAULT_LOOP_H

#include <dflash/dflash.h>
#include <stdbool.h>

/*
 * One path under test. `prepare` makes its inputs in `root` once; `setup` fills a fresh,
 * empty `out` before each run (not counted: no fault lands there); `op` is the work under
 * test, counted and failed. Afterwards every file under `out` must be byte-equal to the same
 * file after a fault-free run or to what `setup` left there, except the files whose names
 * end in one of `varying` (their bytes differ between runs: times), which must only be whole
 * (JSON that parses, JSONL whose every line does, safetensors whose header and data agree).
 */
typedef struct fault_scenario {
  const char *name;
  void (*prepare)(const char *root);
  void (*setup)(const char *root, const char *out); /* may be NULL */
  dflash_status (*op)(const char *root, const char *out);
  const char *const *varying; /* NULL-terminated; may be NULL */
  /* Whether a varying file is whole (NULL) or what is wrong with it; NULL: by its extension. */
  const char *(*whole)(const char *name, const char *text, size_t len);
  /* Findings not fixed yet, each a piece of the failure's text: reported as KNOWN, not
   * failed. NULL-terminated; may be NULL. */
  const char *const *known;
} fault_scenario;

extern const fault_scenario fault_scenarios[];
extern const int fault_n_scenarios;

/* Copy a directory tree (for setups that start from a saved state). */
void fault_copy_tree(const char *from, const char *to);
/* a/b, malloc'd. */
char *fault_path(const char *a, const char *b);
/* Write a file or stop the program (set-up, never under test). */
void fault_write(const char *path, const char *text);
/* Stop the program: a set-up step failed (not a finding). */
void fault_die(const char *what, dflash_status st);

#endif
