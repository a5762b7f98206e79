/*
 * The drafter trainer: the float32 CPU reference and the CUDA backend
 * (forward + backward of the whole drafter and its loss, AdamW, cosine
 * schedule, clipping), anchor sampling, the target's frozen embedding and LM
 * head, checkpoints and resumable training state, evaluation and drafting
 * (propose, the speculative walk), and the GPU memory plan.
 *
 * A trainer is single-owner (see dflash.h). Part of train.h, which includes
 * this header; the oracle hooks (gradients, whole-block logits) are in
 * experimental.h, outside the stable ABI.
 */
#ifndef DFLASH_TRAINER_H
#define DFLASH_TRAINER_H

#include <dflash/dflash.h>
#include <dflash/drafter.h>
#include <dflash/sample.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Default loss decay gamma for a block size: 7 (B=16), 5 (B=10), 4 (B=8),
 * B/2 otherwise. */
DFLASH_API double dflash_trainer_default_loss_gamma(int32_t block_size);

/*
 * Anchor sampling (spec): candidates are positions p with loss_mask[p] &&
 * loss_mask[p+1] && p + block_size <= len; draw min(max_anchors, #candidates)
 * distinct ones uniformly with the generator seeded by (seed, stream) and
 * return them sorted in `out` (capacity max_anchors), count in *n_out. A
 * sample with fewer than 2*block_size supervised tokens yields *n_out = 0.
 * This is DFlash's rule: `dflash train` draws a DSpark drafter's anchors by spec/dspark.md's
 * (p <= len - 2, the block free to leave the sequence, no minimum of supervised tokens).
 */
DFLASH_API dflash_status dflash_anchors_sample(const uint8_t *loss_mask, int64_t len,
                                               int32_t block_size, int32_t max_anchors,
                                               uint64_t seed, uint64_t stream, int32_t *out,
                                               int32_t *n_out);

/* ---- trainer -------------------------------------------------------------- */

typedef enum dflash_backend { DFLASH_BACKEND_CPU = 0, DFLASH_BACKEND_CUDA = 1 } dflash_backend;

typedef struct dflash_trainer_options {
  size_t struct_size;
  int32_t backend;               /* dflash_backend; only CPU here */
  int32_t n_threads;             /* <= 0: one per CPU; OpenBLAS's threads too (process-wide) */
  uint64_t seed;                 /* parameter init and anchor sampling */
  double lr;                     /* peak learning rate (6e-4) */
  double weight_decay;           /* AdamW decoupled decay (0) */
  double beta1, beta2, adam_eps; /* 0.9, 0.95, 1e-8 */
  double grad_clip;              /* global-norm clip (1.0); <= 0 disables */
  double warmup_ratio;           /* of total_steps (0.04) */
  int64_t total_steps;           /* for the cosine schedule; 0: constant lr after warm-up */
  double min_lr_ratio;           /* cosine floor as a fraction of lr (0) */
  double loss_gamma;             /* 0: dflash_trainer_default_loss_gamma(B); < 0: no decay */
  int32_t num_anchors;           /* per sequence (512) */
  int32_t vocab_chunk;           /* LM-head columns per chunk (4096) */
  double init_std;               /* std of the normal init of linear weights (0.02) */
  /* DFlash 2 only (ignored for DFlash 1): loss = block CE + selector_loss_weight
   * x the candidate selector's K-way CE over each supervised position's top-K
   * candidates, the true previous token as predecessor, normalised like the
   * block CE (1.0, >= 0). A position whose true token is not a candidate is
   * left out of the selector term (DFLASH_SELECTOR_LOSS_DROP, the default;
   * candidate recall counts it) or scored with it in place of the lowest
   * candidate (DFLASH_SELECTOR_LOSS_INJECT). */
  double selector_loss_weight;
  int32_t selector_loss_mode;
  /* The learning rate after the warm-up (dflash_lr_schedule): DFLASH_LR_COSINE (the default)
   * or DFLASH_LR_LINEAR decays to min_lr_ratio x lr at total_steps; DFLASH_LR_CONSTANT keeps
   * lr. total_steps 0 keeps lr constant under any schedule. */
  int32_t lr_schedule;
  /* The per-position loss weights (dflash_position_weighting): DFLASH_POSITION_WEIGHTING_DECAY, the
   * default, weighs block position k by exp(-(k-1) / loss_gamma) (1 when loss_gamma < 0);
   * DFLASH_POSITION_WEIGHTING_ADAPTIVE (CPU backend only; CUDA refuses it) weighs each supervised
   * position of a block by the drafter's current probability of reaching it, the product of
   * its probabilities of the true tokens at the block's earlier positions (not
   * differentiated), rescaled so that each block's weights sum to its supervised positions
   * (so dflash_trainer_weight_sum counts 1 per position). It costs one more LM-head pass. */
  int32_t position_weighting;
  /* The optimizer (dflash_optimizer, below). DFLASH_OPTIMIZER_MUON (CPU and CUDA backends;
   * CUDA's runs Newton-Schulz in fp32 on every rank) is torch.optim.Muon, as vLLM speculators trains with it, on every 2-D weight
   * matrix with both sides > 1 but the vocabulary-sized codebooks (fc, the attention and MLP
   * projections, DFlash 2's kernel and hidden projections); AdamW (lr, weight_decay, betas,
   * adam_eps above) keeps the norms and DFlash 2's base kernels and codebooks. Both groups share lr and its schedule. The Muon group's Nesterov momentum
   * (0.95, in [0, 1)) and decoupled weight decay (0.1, >= 0): p *= 1 - lr x decay. The
   * doubles come first so that the struct grows past its old size (no field in its old
   * padding). */
  double muon_momentum;
  double muon_weight_decay;
  int32_t optimizer;
  /* The Muon update's scale (dflash_muon_adjust_lr): DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW, the
   * default (speculators'), lr x 0.2 sqrt(max(rows, cols)); DFLASH_MUON_ADJUST_LR_ORIGINAL (torch's
   * default) lr x sqrt(max(1, rows / cols)). */
  int32_t muon_adjust_lr;
  /* Several ranks: the seconds one collective, and the rendezvous, wait for a rank before
   * DFLASH_E_TIMEOUT naming it (1800, in (0, 1e9]). In the trainer options because a trainer
   * created alone rendezvouses too; dflash_train_run takes it from its `trainer`. (It was the
   * environment's DFLASH_DIST_TIMEOUT.) */
  double dist_timeout_s;
  /* CUDA backend over NCCL: 1 reduce-scatters the gradients in bf16 instead of fp32, half the
   * bytes, at an error per element of up to about (world + 1) x 2^-9 of the ranks' summed
   * magnitudes (docs/gpu.md); 0, the default, in fp32. It changes the results, so it is an
   * option (it was the environment's DFLASH_CUDA_RS_BF16). The CPU backend ignores it. */
  int32_t grad_reduce_bf16;
} dflash_trainer_options;

typedef enum dflash_optimizer {
  DFLASH_OPTIMIZER_ADAMW = 0,
  DFLASH_OPTIMIZER_MUON = 1
} dflash_optimizer;

typedef enum dflash_muon_adjust_lr {
  DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW = 0,
  DFLASH_MUON_ADJUST_LR_ORIGINAL = 1
} dflash_muon_adjust_lr;

typedef enum dflash_lr_schedule {
  DFLASH_LR_COSINE = 0,
  DFLASH_LR_LINEAR = 1,
  DFLASH_LR_CONSTANT = 2
} dflash_lr_schedule;

typedef enum dflash_position_weighting {
  DFLASH_POSITION_WEIGHTING_DECAY = 0,
  DFLASH_POSITION_WEIGHTING_ADAPTIVE = 1
} dflash_position_weighting;

typedef enum dflash_selector_loss_mode {
  DFLASH_SELECTOR_LOSS_DROP = 0,
  DFLASH_SELECTOR_LOSS_INJECT = 1
} dflash_selector_loss_mode;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_trainer_options_default(&opts). */
DFLASH_API void dflash_trainer_options_init(dflash_trainer_options *opts, size_t size);
#define dflash_trainer_options_default(opts) dflash_trainer_options_init((opts), sizeof *(opts))

typedef struct dflash_trainer dflash_trainer;

/*
 * A trainer for `cfg` with the target's frozen token embedding and LM head,
 * both float32 row-major [vocab_size, hidden_size] (copied). Parameters are
 * initialised like Qwen3 (norm weights 1, linear weights N(0, init_std²)).
 */
DFLASH_API dflash_status dflash_trainer_create(const dflash_drafter_config *cfg, const float *embed,
                                               const float *lm_head,
                                               const dflash_trainer_options *opts,
                                               dflash_trainer **out);
DFLASH_API void dflash_trainer_free(dflash_trainer *t);

/* Trainable tensors, in buffer order, by checkpoint name ("fc.weight"...). */
DFLASH_API size_t dflash_trainer_param_count(const dflash_trainer *t);
/* Name (borrowed), rank (1 or 2), shape (2 entries; [n, 1] for vectors) and
 * element count of tensor `index`. DFlash 2's base kernels, [2, k, H] in the
 * checkpoint, are reported as rank 2, [2, k * H] (the same row-major data). */
DFLASH_API dflash_status dflash_trainer_param_info(const dflash_trainer *t, size_t index,
                                                   const char **name, int32_t *ndim,
                                                   int64_t shape[2], size_t *numel);
/* Copy a parameter out, or in; `n` must equal the tensor's element count.
 * (Its gradient: dflash_trainer_get_grad, experimental.h.) */
DFLASH_API dflash_status dflash_trainer_get_param(const dflash_trainer *t, const char *name,
                                                  float *out, size_t n);
DFLASH_API dflash_status dflash_trainer_set_param(dflash_trainer *t, const char *name,
                                                  const float *in, size_t n);
/*
 * The sequence calls below each take one `const dflash_sample *` (sample.h): the caller sets
 * struct_size (sizeof), len, input_ids, loss_mask where the call reads it, the hidden rows
 * (float32 `hidden` [len, K*hidden_size], or, with hidden NULL, the stored codes of
 * hidden_dtype / hidden_codes / hidden_scales, decoded on the host wherever float32 is needed)
 * and the block anchors [n_anchors] in [0, len); a sample from a stream or spool is used as it
 * comes with its anchors set. One struct rather than six arguments so that a sequence is described
 * once, the same way for training, evaluation and drafting, and grows by appended fields (the
 * one struct rule) instead of new signatures. An anchor outside [0, len) is DFLASH_E_RANGE
 * naming it. The sample's pointers need only stay valid until the call returns.
 */

/*
 * One sequence at its anchors (no sampling). Sets the gradients (replacing earlier ones) of
 * loss = sum(w*CE) / sum(w) and returns the loss (0 when sum(w) is 0). A DSpark drafter's
 * loss is spec/dspark.md's sum(w (0.1 CE + 0.9 L1 + 1.0 BCE)) / sum(w) over its anchor-first
 * slots (w_k = exp(-k / loss_gamma), gamma 4 by default), the L1 and BCE terms only with
 * the sample's target_final (else 0.1 CE alone); "CE" below stands for that whole term. It waits for the
 * device, and leaves the sums that dflash_trainer_collect returns as they were.
 */
DFLASH_API dflash_status dflash_trainer_forward_backward(dflash_trainer *t, const dflash_sample *s,
                                                         double *loss);

/*
 * Batched training: zero_grad, then accumulate each sequence with `grad_scale` (e.g. 1 / total
 * weight of the batch, dflash_trainer_weight_sum), then step. accumulate adds
 * grad_scale * d(sum w*CE). Its hidden rows are float32 or as stored (bf16 / fp8 codes,
 * dflash_sample_stream_options.stored_rows), and it does not wait for the device: the CUDA
 * backend uploads the stored rows through pinned double buffers on a copy stream while the
 * previous sequence computes, converts them and checks them for NaN/Inf on the device, and
 * keeps the loss there. So this returns no loss: sum(w*CE) and sum(w) of every sequence
 * accumulated since the last collect come from dflash_trainer_collect (one wait for the
 * device), and a NaN/Inf row found on the device fails collect naming the sample's id — or,
 * if collect was not called, dflash_trainer_step, which then changes no parameter. The CPU
 * backend computes at once (stored rows decoded on the host) and only defers the sums. Rows
 * past the last anchor are never read, and on CUDA never checked.
 */
DFLASH_API dflash_status dflash_trainer_zero_grad(dflash_trainer *t);
DFLASH_API dflash_status dflash_trainer_accumulate(dflash_trainer *t, const dflash_sample *s,
                                                   double grad_scale);
/* sum(w*CE) and sum(w) (either may be NULL) of the accumulate calls since the last
 * collect; waits for the device. DFLASH_E_FORMAT naming the sample for a NaN/Inf hidden row
 * (the sums then still count every sequence, and the bad one's gradients are in the buffer:
 * zero_grad before accumulating again). */
DFLASH_API dflash_status dflash_trainer_collect(dflash_trainer *t, double *loss_sum,
                                                double *weight_sum);
/* The position weights sum(w) that the sample's anchors carry (reads len, loss_mask and the
 * anchors only). */
DFLASH_API dflash_status dflash_trainer_weight_sum(const dflash_trainer *t, const dflash_sample *s,
                                                   double *weight_sum);
/* Clip the global gradient norm, apply AdamW at the scheduled learning
 * rate, advance the step. Returns the pre-clip norm and the lr used. */
DFLASH_API dflash_status dflash_trainer_step(dflash_trainer *t, double *grad_norm, double *lr);
/*
 * dflash_trainer_step without waiting for the device: the CUDA backend enqueues the last
 * sequence's backward, the gradient reduce-scatter, the global norm, the clip factor and
 * AdamW (which skips a non-finite norm) and the weight all-gather, all computed on the
 * device, and returns, so that the next step's first sequence (dflash_trainer_zero_grad,
 * dflash_trainer_accumulate) is copied and uploaded while they run; stream order keeps
 * the next forward behind the updated weights. The step counts at once (lr: the rate used).
 * Its pre-clip norm comes from dflash_trainer_step_result, which waits for the step (not
 * for what was enqueued after it); call it once per step_async (a later step or step_async
 * calls it first, and fails as it would). The CPU backend steps at once and keeps the norm
 * for step_result.
 */
DFLASH_API dflash_status dflash_trainer_step_async(dflash_trainer *t, double *lr);
/* The pre-clip norm of the last dflash_trainer_step_async. A non-finite norm is
 * DFLASH_E_RANGE: the step changed nothing and no longer counts (dflash_trainer_step_count
 * goes back by one). DFLASH_E_STATE when no step_async is outstanding. */
DFLASH_API dflash_status dflash_trainer_step_result(dflash_trainer *t, double *grad_norm);
/* Optimizer steps taken so far (named apart from dflash_trainer_step, which takes one). */
DFLASH_API int64_t dflash_trainer_step_count(const dflash_trainer *t);
/* Learning rate of step `step` (0-based): linear warm-up over
 * warmup_ratio*total_steps steps, then the lr_schedule (cosine by default) to
 * min_lr_ratio*lr. */
DFLASH_API double dflash_trainer_lr_at(const dflash_trainer *t, int64_t step);

/* ---- target weights ------------------------------------------------------- */

/*
 * Read the target's frozen token embedding and LM head, float32 [vocab_size,
 * hidden_size] each, from its checkpoint (a .safetensors file, an index, or
 * a directory of shards). Names NULL: the usual ones are tried
 * (model.embed_tokens.weight, lm_head.weight and their language_model.*
 * variants); a target without an LM head tensor has tied embeddings. Shapes
 * must match the config (hidden size and vocabulary) exactly.
 */
DFLASH_API dflash_status dflash_target_load_head(const char *path, const char *embed_name,
                                                 const char *lm_head_name, int32_t vocab_size,
                                                 int32_t hidden_size, float *embed, float *lm_head);

/*
 * A DSpark drafter's pruned draft vocabulary (dflash_drafter_config.draft_vocab_size V_d
 * below vocab_size): kept [n] the target ids it drafts over, strictly ascending in
 * [0, vocab_size), n = V_d (dflash_draft_vocab_select picks them from a dataset). The
 * drafter's LM head becomes the target head's rows at `kept` (frozen), and its CE labels
 * map through them (a label outside them adds no CE; spec/dspark.md section 4). A fresh
 * trainer holds the lowest V_d ids and refuses to train (DFLASH_E_STATE) until they are set
 * here or dflash_trainer_load has read a checkpoint's tables: the Markov head's W2 rows
 * follow the kept ids by position. DFLASH_E_CONFIG for a drafter that is not
 * pruned, DFLASH_E_MISMATCH for n != V_d, DFLASH_E_FORMAT naming the first id out of range
 * or not ascending.
 */
DFLASH_API dflash_status dflash_trainer_set_draft_vocab(dflash_trainer *t, const int32_t *kept,
                                                        int32_t n);
/* The kept ids (V_d of them; all vocab_size ids, 0..V-1, when not pruned) into kept[cap]
 * (NULL with cap 0: *n only); *n gets the count. DFLASH_E_BUFFER when cap is short. */
DFLASH_API dflash_status dflash_trainer_draft_vocab(const dflash_trainer *t, int32_t *kept,
                                                    int32_t cap, int32_t *n);

/* ---- checkpoints ---------------------------------------------------------- */

/*
 * Save a drafter checkpoint directory that SGLang/vLLM load: config.json +
 * model.safetensors (checkpoint names, F32 or BF16; config.json's "dtype" and
 * "torch_dtype" name it). The directory is created if needed; files are
 * written atomically. Launch flags: docs/deployment.md, "Serving the checkpoint".
 * A pruned DSpark drafter adds lm_head.weight [V_d, H] (the kept rows), d2t I64 [V_d]
 * (offsets: target id = i + d2t[i]) and t2d BOOL [vocab_size] (spec/dspark.md section 5).
 */
DFLASH_API dflash_status dflash_trainer_save(const dflash_trainer *t, const char *dir,
                                             int32_t bf16);
/* Load parameters from a checkpoint directory or .safetensors file (F32 or
 * BF16); every trainable tensor must be present with its shape. A pruned DSpark drafter
 * also reads d2t and t2d, refusing malformed tables naming the tensor (DFLASH_E_NOT_FOUND
 * absent, DFLASH_E_DTYPE, DFLASH_E_MISMATCH wrong length, DFLASH_E_FORMAT an id out of
 * range, repeated or not ascending, or t2d disagreeing with d2t), and checks lm_head.weight's
 * shape when present; a drafter that is not pruned refuses a checkpoint with d2t. */
DFLASH_API dflash_status dflash_trainer_load(dflash_trainer *t, const char *path);

/*
 * Training state (optimizer moments, step, master parameters, and a caller
 * blob for data position and RNG state) in one safetensors file, written
 * atomically, so a killed run resumes bit-for-bit.
 */
DFLASH_API dflash_status dflash_trainer_save_state(const dflash_trainer *t, const char *path,
                                                   const void *user, size_t user_len);
/* Restore state; the caller blob is copied into `user` (capacity `cap` bytes;
 * its size in *user_len; DFLASH_E_BUFFER when cap is smaller). `user` NULL
 * only asks for the size: *user_len set, DFLASH_OK, nothing restored. */
DFLASH_API dflash_status dflash_trainer_load_state(dflash_trainer *t, const char *path, void *user,
                                                   size_t cap, size_t *user_len);

/* ---- evaluation ----------------------------------------------------------- */

/*
 * Acceptance at each of the sample's anchors: accept[i] (the caller's [n_anchors]) = number
 * of leading block positions k = 1.. whose greedy prediction equals input_ids[anchor + k]
 * (positions past the end stop the count), so tau_i = 1 + accept[i]. The predictions
 * themselves come from dflash_trainer_propose. A DSpark drafter drafts B tokens a block
 * (anchor-first: slot k = 0..B-1 predicts input_ids[anchor + k + 1], the greedy chain), so
 * accept[i] runs to B there.
 */
DFLASH_API dflash_status dflash_trainer_acceptance(dflash_trainer *t, const dflash_sample *s,
                                                   int32_t *accept);

/* ---- evaluation over a dataset ------------------------------------------- */

/*
 * dflash_trainer_eval's inputs and results, in one struct as dflash_eval_walk is: the two
 * evaluations stay two calls because they cost and answer differently (this one drafts at
 * anchors_per_seq sampled anchors, as training does, for a quick tau; the walk drafts at
 * every position and chains them), and a mode field in one struct would leave half its
 * results meaningless in each mode.
 */
typedef struct dflash_eval {
  size_t struct_size;
  /* in */
  int32_t anchors_per_seq; /* anchors drawn per sample by the training rule (64, > 0) */
  uint64_t seed;           /* of the anchor draw (1) */
  double *accuracy;        /* NULL or [B-1] (DSpark: [B]): per draft, the fraction drafted right */
  /* out */
  double tau;       /* mean acceptance length 1 + accept over the blocks */
  int64_t n_blocks; /* anchors drafted */
} dflash_eval;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_eval_default(&e). */
DFLASH_API void dflash_eval_init(dflash_eval *e, size_t size);
#define dflash_eval_default(e) dflash_eval_init((e), sizeof *(e))

/*
 * Mean acceptance length tau over a held-out dataset: up to e->anchors_per_seq anchors per
 * sample (the training rule, seeded by e->seed: DSpark's lets a block leave the sequence, its
 * accuracy counting the drafts inside it); e is read for its inputs and written with
 * its results up to its struct_size.
 */
DFLASH_API dflash_status dflash_trainer_eval(dflash_trainer *t, const char *data_dir,
                                             const char *hidden_dir, dflash_eval *e);

/*
 * The speculative walk: what greedy speculative decoding gains on a sequence
 * whose supervised tokens are the target's own greedy continuation. Live
 * decoding chains its anchors (each step jumps past what it accepted), so
 * easy stretches take few steps; its tau = tokens / steps is lower than the
 * mean over uniformly drawn anchors, and this is the number to predict it.
 *
 * Per maximal run [s, e) of the sample's loss_mask = 1 (cut to s + max_tokens when
 * max_tokens > 0): the first anchor is s (the token the target's prefill
 * produces); a step at anchor p drafts p+1..p+B-1, keeps the leading drafts
 * equal to input_ids (up to e-1) and gains them plus the target's next token,
 * at most e-1-p in all; the next anchor is the last token gained. So a run
 * gives e-1-s tokens; the sample's own anchors are not read. `accept` [len] (may be NULL)
 * receives the acceptance at EVERY position p of a run with p < e-1 (as
 * dflash_trainer_acceptance, counting stops at e) and -1 elsewhere. `step_hist` [B] (may be
 * NULL) is incremented at index gain-1 for each step.
 *
 * A DSpark drafter drafts p+1..p+B at anchor p (anchor-first, spec/dspark.md section 1),
 * d_0 the argmax of slot 0 with the Markov head on the anchor's token and d_k the argmax of
 * slot k with it on d_{k-1} (its own drafts, as llama.cpp, vLLM and SGLang chain them at
 * T = 0; a pruned vocabulary's picks mapped to target ids), so a step gains up to B + 1
 * tokens and `step_hist` is [B + 1].
 */
DFLASH_API dflash_status dflash_trainer_walk(dflash_trainer *t, const dflash_sample *s,
                                             int32_t max_tokens, int64_t *tokens, int64_t *steps,
                                             int32_t *accept, int64_t *step_hist);

typedef struct dflash_eval_walk {
  size_t struct_size;
  /* in */
  int32_t max_tokens; /* per supervised run (0: all); set it to the generation cap */
  /* Sizes by the drafts a block, nd = B - 1 (DFlash) or B (DSpark, anchor-first): */
  double *accuracy;   /* NULL or [nd]: per draft, over every anchor position */
  int64_t *step_hist; /* NULL or [nd + 1]: walk steps that gained 1..nd + 1 tokens (zeroed
                         first) */
  /* out */
  int64_t sequences; /* samples with at least one walk step */
  int64_t steps, tokens;
  double walk_tau;     /* tokens / steps */
  double walk_tau_se;  /* standard error, ratio estimator over sequences */
  int64_t positions;   /* anchors at every position: the uniform-anchor mean */
  double position_tau; /* mean 1 + acceptance over them */
  double position_tau_se;
  /* out (appended): over the `scored` drafted positions of those anchors
   * (block positions k with anchor + k inside the run), the fraction where
   * the drafted token (DFlash 2: the selector's greedy path) equals the true
   * token, where the drafter's plain argmax does (the backbone), and where
   * the true token is among the top selector_top_k logits (the candidates;
   * -1 for DFlash 1, which has none). */
  int64_t scored;
  double selector_accuracy;
  double backbone_accuracy;
  double candidate_recall;
  /* in (appended): dflash_train_labels, what a draft is compared with: the data's next token
   * (DFLASH_TRAIN_LABELS_DATA, default: right for greedy data only), or the target's greedy token
   * from the store's target ids (DFLASH_TRAIN_LABELS_TARGET: what greedy verification accepts,
   * also on data sampled at T > 0; a sample without them is DFLASH_E_NOT_FOUND). The
   * context stays the data's. */
  int32_t labels;
  /* in (appended): a DSpark drafter with the confidence head only (left alone otherwise),
   * each NULL or the caller's [B]. Per slot k, over the walk's steps (the anchors live
   * decoding drafts at) that reached slot k (drafts 0..k-1 accepted, anchor + k + 1 inside
   * the run): the mean predicted acceptance sigmoid(confidence logit) along the greedy
   * chain, the head's value at that slot in an engine (conf_predicted), the fraction of
   * those slots accepted (conf_observed) and how many they are (conf_count). */
  double *conf_predicted;
  double *conf_observed;
  int64_t *conf_count;
  /* out (appended), DSpark only: the probabilistic tau of spec/dspark.md section 6,
   * 1 + sum_k prod_{j <= k} (1 - L1_j / 2) over the slots inside the run, teacher-forced
   * (slot j's Markov head on the data's token, the target's distribution q_j from the store's
   * final state at anchor + j through the frozen LM head), averaged over position_tau's
   * anchors, with its standard error (over sequences, as position_tau_se). A pruned
   * drafter's L1 is over the full vocabulary, p zero outside the kept ids, so 1 - L1 / 2 is
   * sum_kept min(p, q), what rejection sampling accepts. -1 (both) for DFlash and when a
   * sample carries no final state (a store written without final_state). */
  double prob_tau;
  double prob_tau_se;
  /* The confidence head's expected calibration error over the slots of conf_count:
   * sum over 10 equal-width bins of predicted acceptance of |sum predicted - sum accepted|,
   * divided by the slots; -1 for DFlash, a drafter without the head, or no slot. */
  double conf_ece;
} dflash_eval_walk;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_eval_walk_default(&w). */
DFLASH_API void dflash_eval_walk_init(dflash_eval_walk *w, size_t size);
#define dflash_eval_walk_default(w) dflash_eval_walk_init((w), sizeof *(w))

/*
 * dflash_trainer_walk over every sample of a held-out dataset, plus the
 * acceptance at every position (the exact value that dflash_trainer_eval's
 * sampled anchors estimate). Standard errors treat sequences as the
 * independent units: se(sum x / sum n) by the delta method. A DSpark drafter: B drafts a
 * block as in dflash_trainer_walk, plus its probabilistic tau and the confidence head's
 * calibration (the fields above).
 */
DFLASH_API dflash_status dflash_trainer_eval_walk(dflash_trainer *t, const char *data_dir,
                                                  const char *hidden_dir, dflash_eval_walk *w);


/* ---- GPU memory plan (CUDA backend) --------------------------------------- */

typedef struct dflash_train_plan_options {
  size_t struct_size;
  int32_t world_size;      /* data-parallel GPUs (1) */
  int32_t seq_len;         /* longest sequence, tokens (3072) */
  int32_t num_anchors;     /* blocks per sequence (512) */
  int32_t batch_size;      /* sequences per GPU per step; accumulated one at a time, so
                             memory does not depend on it. 0 (the default): the count the
                             trainer picks, 1 or, with several ranks and pcie, 4 */
  int32_t vocab_chunk;     /* LM-head columns per chunk on the GPU (8192) */
  int32_t zero1;           /* shard fp32 masters and AdamW moments over ranks (1) */
  uint64_t gpu_bytes;      /* memory per GPU (80e9) */
  uint64_t reserve_bytes;  /* kept free: CUDA context, cuBLAS workspace, NCCL
                             buffers, fragmentation (4 GiB) */
  uint64_t smem_per_block; /* the GPU's shared memory per block (opt-in), bytes, from which
                              the attention's tiles are chosen (232448: H100, H200, B200,
                              B300; 101376: RTX PRO 6000 and other sm_120); 0: not checked */
  int32_t pcie;            /* 1: the GPUs talk over PCIe, no NVLink (RTX PRO 6000 and other
                              sm_120, sm_89, sm_86 machines); with batch_size 0 and several
                              ranks the trainer then takes 4 sequences per step (0) */
  int32_t device;          /* >= 0: read gpu_bytes, smem_per_block and pcie from this CUDA
                              device (DFLASH_E_NO_DEVICE / _UNSUPPORTED when there is none or
                              the library has no CUDA); -1: as set above (-1) */
  int32_t optimizer;       /* dflash_optimizer: DFLASH_OPTIMIZER_MUON adds the Muon step's
                              workspace (its largest matrix twice, its Gram matrix twice, fp32)
                              to the activations' scratch (DFLASH_OPTIMIZER_ADAMW) */
} dflash_train_plan_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_train_plan_options_default(&opts). */
DFLASH_API void dflash_train_plan_options_init(dflash_train_plan_options *opts, size_t size);
#define dflash_train_plan_options_default(opts) \
  dflash_train_plan_options_init((opts), sizeof *(opts))

/* Bytes per GPU, each term as the CUDA backend allocates it. */
typedef struct dflash_train_plan {
  size_t struct_size;
  uint64_t n_params;    /* trainable parameters */
  uint64_t weights;     /* bf16 copies of the trainable weights: 2 B/param */
  uint64_t masters;     /* fp32 master weights: 4 B/param, / world with ZeRO-1 */
  uint64_t moments;     /* AdamW m and v: 8 B/param, / world with ZeRO-1 */
  uint64_t grads;       /* fp32 gradients, whole on every rank: 4 B/param */
  uint64_t activations; /* one sequence: saved activations + backward scratch */
  uint64_t frozen;      /* bf16 target embedding + LM head: 2 * 2 * V * H */
  uint64_t reserve;     /* reserve_bytes */
  uint64_t total;       /* sum of the above */
  uint64_t gpu_bytes;
  int32_t attention_rows;     /* query rows per attention CTA: block size x query heads
                                 per kv head, rounded up to 16 */
  int32_t attention_key_tile; /* keys per tile, the narrowest of the three kernels (64,
                                 32 or 16); 0 when one of them does not fit */
  uint64_t attention_smem;    /* shared memory per block of the widest kernel at those
                                 tiles (or, when one does not fit, its need at 16 keys) */
  int32_t sequences_per_step; /* per GPU per optimizer step: batch_size, or the trainer's
                                 pick when it is 0; accumulated one at a time with one
                                 reduce-scatter and one all-gather */
  char device_name[96];       /* with options.device: the device's name and architecture
                                 ("NVIDIA H200 (sm_90)"); else empty */
} dflash_train_plan;

/*
 * Fill `plan` up to the plan.struct_size the caller sets (ZeRO-1 shards use
 * the buffer padded to a multiple of the world size). When total > gpu_bytes,
 * DFLASH_E_NOMEM with a message naming the largest term and what shrinks it;
 * when the attention's tiles do not fit smem_per_block, DFLASH_E_UNSUPPORTED naming
 * the kernel and the bytes; `plan` is filled either way. DFlash 2 counts its parameters (per layer
 * 2 x (2 k H + 2 k H / g x H), and 2 V r + r H for the selector; its codebooks
 * alone are 2 V r, 84 M at V = 163840, r = 256); the CUDA backend does not
 * train DFlash 2 yet: that plan is the size it would have, the activations
 * are DFlash 1's.
 */
DFLASH_API dflash_status dflash_train_plan_compute(const dflash_drafter_config *cfg,
                                                   const dflash_train_plan_options *opts,
                                                   dflash_train_plan *plan);

/* ---- drafting ------------------------------------------------------------- */

/*
 * Drafting as z-lab's propose does (DFlash 2's CandidateSelector.select), with
 * the sampling path for lossless rejection sampling. At each drafted
 * position i of a block the candidates are the top selector_top_k tokens of
 * the logits (descending logit, ties to the smaller id), scored
 * s_c = logit_c + <A(prev) * P(h_i), B(c)> with prev the token drafted at
 * i - 1 (the block's own token at the first); temperature 0 takes the best
 * (DFlash 1: the argmax), temperature > 0 draws from
 * q = softmax(s / temperature) over the candidates. A draw depends only on
 * `seed`, the block's anchor position and the drafter: the same call, or the
 * same anchor in another call, draws the same tokens.
 */
typedef struct dflash_propose_options {
  size_t struct_size;
  double temperature; /* 0 (default): greedy; > 0: sampled (DFlash 2 only) */
  uint64_t seed;
} dflash_propose_options;

/* The defaults (greedy, seed 0) written up to `size` bytes, the caller's
 * sizeof (the versioned-struct rule of dflash.h). Call it as
 * dflash_propose_options_default(&opts). */
DFLASH_API void dflash_propose_options_init(dflash_propose_options *o, size_t size);
#define dflash_propose_options_default(o) dflash_propose_options_init((o), sizeof *(o))

/*
 * What dflash_trainer_propose writes beyond the drafted tokens: each field NULL (not asked
 * for) or the caller's buffer, set before the call and only read by the library (so the
 * struct is read by the one struct rule, as options are; its own bytes are never written).
 * Apart from the options, which only steer the draft, so that an options struct holds no
 * output. Per drafted position, [n_anchors, B-1, selector_top_k] its candidates and, with
 * temperature > 0, q over them (what rejection sampling accepts against; DFlash 2 only);
 * [n_anchors, B-1] the drafter's plain argmax (DFlash 1's prediction, the backbone's for
 * DFlash 2).
 */
typedef struct dflash_propose_outputs {
  size_t struct_size;
  int32_t *candidates;
  float *probs;
  int32_t *argmax;
} dflash_propose_outputs;

/*
 * Draft B-1 tokens after each of the sample's anchors into `pred` [n_anchors, B-1] as above
 * (a DSpark drafter: B tokens, [n_anchors, B], slot k drafting anchor + k + 1 greedily, each
 * slot's Markov bias on the token drafted at the slot before, the anchor's at slot 0; argmax
 * the same [n_anchors, B])
 * (opts NULL: greedy, the drafter's prediction; out NULL: nothing more). Sampling or
 * candidates from a DFlash 1 drafter: DFLASH_E_UNSUPPORTED; a negative or non-finite
 * temperature: DFLASH_E_RANGE. Anything beyond the greedy tokens runs the float32 reference
 * forward on the host copy of the parameters, as dflash_trainer_logits does.
 */
DFLASH_API dflash_status dflash_trainer_propose(dflash_trainer *t, const dflash_sample *s,
                                                const dflash_propose_options *opts, int32_t *pred,
                                                const dflash_propose_outputs *out);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_TRAINER_H */
