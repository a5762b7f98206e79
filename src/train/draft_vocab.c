/*
 * DSpark's pruned draft vocabulary (spec/dspark.md section 4): the selection from supervised
 * token counts, the kept ids' tables on the model (t2d, the LM head's kept rows) and the
 * trainer calls that set and read them. The checkpoint's d2t / t2d are checkpoint.c's.
 */
#include <dflash/dataset.h>
#include <stdlib.h>
#include <string.h>

#include "trainer.h"

typedef struct vocab_rank {
  int64_t count;
  int32_t id;
} vocab_rank;

/* More frequent first; ties: the lower id (speculators' rule). Zero counts sort by id, so
 * the tail is the lowest unused ids: the rule's fill. */
static int by_count(const void *a, const void *b) {
  const vocab_rank *x = a, *y = b;
  if (x->count != y->count) return x->count > y->count ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static int by_id(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

dflash_status dflash_draft_vocab_select(const int64_t *counts, int32_t vocab_size,
                                        int32_t draft_vocab_size, int32_t *kept, double *coverage) {
  DF_CHECK_ARG(counts && kept);
  if (vocab_size < 1 || draft_vocab_size < 1 || draft_vocab_size > vocab_size)
    return df_error(DFLASH_E_INVALID_ARG,
                    "draft vocabulary: draft_vocab_size %d must be in 1..vocab_size %d",
                    draft_vocab_size, vocab_size);
  vocab_rank *r = malloc(sizeof *r * (size_t)vocab_size);
  if (!r) return df_error_nomem("draft vocabulary ranks");
  double total = 0, cov = 0;
  for (int32_t i = 0; i < vocab_size; i++) {
    if (counts[i] < 0) {
      free(r);
      return df_error(DFLASH_E_INVALID_ARG, "draft vocabulary: counts[%d] is negative (%lld)", i,
                      (long long)counts[i]);
    }
    r[i] = (vocab_rank){counts[i], i};
    total += (double)counts[i];
  }
  qsort(r, (size_t)vocab_size, sizeof *r, by_count);
  for (int32_t i = 0; i < draft_vocab_size; i++) {
    kept[i] = r[i].id;
    cov += (double)r[i].count;
  }
  free(r);
  qsort(kept, (size_t)draft_vocab_size, sizeof *kept, by_id);
  if (coverage) *coverage = total > 0 ? cov / total : 0.0;
  return DFLASH_OK;
}

dflash_status dflash_draft_vocab_from_dataset(const struct dflash_dataset *ds, int32_t vocab_size,
                                              int32_t draft_vocab_size, int32_t *kept,
                                              double *coverage) {
  DF_CHECK_ARG(ds && kept);
  if (vocab_size < 1)
    return df_error(DFLASH_E_INVALID_ARG, "draft vocabulary: vocab_size %d", vocab_size);
  int64_t *counts = malloc(sizeof(int64_t) * (size_t)vocab_size);
  if (!counts) return df_error_nomem("token counts");
  dflash_status st = dflash_dataset_token_counts(ds, vocab_size, counts, NULL);
  if (!st) st = dflash_draft_vocab_select(counts, vocab_size, draft_vocab_size, kept, coverage);
  free(counts);
  return st;
}

dflash_status df_draft_vocab_check(const int32_t *kept, int64_t n, int32_t V, const char *what) {
  for (int64_t i = 0; i < n; i++) {
    if (kept[i] < 0 || kept[i] >= V)
      return df_error(DFLASH_E_FORMAT,
                      "%s: entry %lld maps to target id %d, outside the vocabulary [0, %d)", what,
                      (long long)i, kept[i], V);
    if (i > 0 && kept[i] <= kept[i - 1])
      return df_error(DFLASH_E_FORMAT,
                      "%s: entry %lld maps to target id %d after %d: the kept ids must be "
                      "strictly ascending (%s)",
                      what, (long long)i, kept[i], kept[i - 1],
                      kept[i] == kept[i - 1] ? "a duplicate" : "out of order");
  }
  return DFLASH_OK;
}

dflash_status df_model_set_draft_vocab(df_model *m, const int32_t *kept, const char *what) {
  if (m->Vd >= m->V) return DFLASH_OK;
  dflash_status st = kept ? df_draft_vocab_check(kept, m->Vd, m->V, what) : DFLASH_OK;
  if (st) return st;
  if (!m->kept) m->kept = malloc(sizeof(int32_t) * (size_t)m->Vd);
  if (!m->t2d) m->t2d = malloc(sizeof(int32_t) * (size_t)m->V);
  if (!m->kept || !m->t2d) return df_error_nomem("draft vocabulary tables");
  for (int i = 0; i < m->Vd; i++) m->kept[i] = kept ? kept[i] : i;
  m->dv_set = kept != NULL;
  m->dv_gen++;
  for (int v = 0; v < m->V; v++) m->t2d[v] = -1;
  for (int i = 0; i < m->Vd; i++) {
    m->t2d[m->kept[i]] = i;
    memcpy(m->lm_head + (size_t)i * m->H, m->lm_head_full + (size_t)m->kept[i] * m->H,
           sizeof(float) * (size_t)m->H);
  }
  return DFLASH_OK;
}

dflash_status df_model_draft_vocab_ready(const df_model *m) {
  if (!m->kept || m->dv_set) return DFLASH_OK;
  return df_error(DFLASH_E_STATE,
                  "a pruned draft vocabulary (draft_vocab_size %d) trains only once its kept ids "
                  "are set (dflash_trainer_set_draft_vocab with dflash_draft_vocab_from_dataset, "
                  "or a checkpoint's d2t through dflash_trainer_load)",
                  m->Vd);
}

dflash_status dflash_trainer_set_draft_vocab(dflash_trainer *t, const int32_t *kept, int32_t n) {
  DF_CHECK_ARG(t && kept);
  df_model *m = &t->m;
  if (m->Vd >= m->V)
    return df_error(DFLASH_E_CONFIG,
                    "draft vocabulary: this drafter is not pruned (draft_vocab_size %d, "
                    "vocab_size %d)",
                    m->cfg.draft_vocab_size, m->V);
  if (n != m->Vd)
    return df_error(DFLASH_E_MISMATCH, "draft vocabulary: %d ids given, draft_vocab_size is %d", n,
                    m->Vd);
  return df_model_set_draft_vocab(m, kept, "draft vocabulary");
}

dflash_status dflash_trainer_draft_vocab(const dflash_trainer *t, int32_t *kept, int32_t cap,
                                         int32_t *n) {
  DF_CHECK_ARG(t && n && (kept || cap == 0));
  const df_model *m = &t->m;
  *n = m->Vd;
  if (!kept || cap < m->Vd)
    return df_error(DFLASH_E_BUFFER, "draft vocabulary: %d ids, room for %d", m->Vd, cap);
  for (int i = 0; i < m->Vd; i++) kept[i] = m->kept ? m->kept[i] : i;
  return DFLASH_OK;
}

dflash_status df_trainer_draft_vocab_from_data(dflash_trainer *t, const char *data_dir,
                                               double *coverage) {
  df_model *m = &t->m;
  if (m->Vd >= m->V) return DFLASH_OK;
  if (!data_dir)
    return df_error(DFLASH_E_CONFIG,
                    "a pruned draft vocabulary (draft_vocab_size %d) is picked from the training "
                    "dataset's supervised tokens; this run has no dataset",
                    m->Vd);
  dflash_dataset *ds = NULL;
  int32_t *kept = malloc(sizeof(int32_t) * (size_t)m->Vd);
  double cov = 0;
  dflash_status st = kept ? dflash_dataset_open(data_dir, &ds) : df_error_nomem("draft vocabulary");
  if (!st) st = dflash_draft_vocab_from_dataset(ds, m->V, m->Vd, kept, &cov);
  if (!st) st = df_model_set_draft_vocab(m, kept, data_dir);
  dflash_dataset_free(ds);
  free(kept);
  if (st) return df_error_wrap(st, "picking the draft vocabulary from %s", data_dir);
  df_log(DFLASH_LOG_INFO,
         "train: draft vocabulary %d of %d tokens covers %.4f%% of the supervised tokens of %s "
         "(acceptance cannot exceed it)",
         m->Vd, m->V, 100.0 * cov, data_dir);
  if (coverage) *coverage = cov;
  return DFLASH_OK;
}
