/*
 * Trainer backends: where the drafter's parameters, gradients and optimizer
 * state live and where forward/backward and the optimizer step run.
 *
 * The trainer always owns float32 host buffers with df_model's layout
 * (m.params, m.grads, m1, m2). For the CPU backend they ARE the storage. A
 * device backend keeps its own copies and moves them with pull (device ->
 * host) and push (host -> device); the trainer pulls before anything reads a
 * host buffer (get_param, checkpoints) and pushes after anything writes one
 * (set_param, load). `stale` marks host buffers older than the device's.
 */
#ifndef DFLASH_TRAIN_BACKEND_H
#define DFLASH_TRAIN_BACKEND_H

#include "act_layout.h"
#include "trainer.h"

typedef enum df_buf_kind {
  DF_BUF_PARAMS = 1,
  DF_BUF_GRADS = 2,
  DF_BUF_M1 = 4,
  DF_BUF_M2 = 8,
} df_buf_kind;

/* One sequence of a batch (see dflash_trainer_accumulate). */
typedef struct df_seq {
  const int32_t *ids;
  const uint8_t *loss_mask; /* NULL for prediction */
  int64_t len;
  const float *hidden; /* [len, K*H] */
  const int32_t *anchors;
  int32_t n_anchors;
  const int32_t *labels; /* CE targets [len] (the target's greedy tokens); NULL: ids */
  /* The hidden rows as stored, for a backend with stored_rows (hidden is then NULL):
   * DFLASH_DTYPE_BF16 codes, or DFLASH_DTYPE_F8_E4M3 codes with scales [len, K]. */
  int32_t hidden_dtype;
  const void *hidden_codes;
  const float *hidden_scales;
  const char *id;     /* the sample's id for a deferred error (NULL: unnamed) */
  const float *final; /* DSpark: the target's post-norm final state [len, H], or NULL */
} df_seq;

/* One optimizer step's hyper-parameters (learning rate already scheduled). */
typedef struct df_adam {
  double lr, weight_decay, beta1, beta2, eps, grad_clip;
  int64_t step; /* 1-based index of this update, for bias correction */
  /* DFLASH_OPTIMIZER_MUON: Muon on df_muon_takes' matrices (CPU and CUDA backends), its momentum
   * buffer in m1 (so checkpoints save and resume it as adam_m; m2 stays 0 there). */
  bool muon;
  double muon_momentum, muon_weight_decay;
  int32_t muon_adjust_lr; /* dflash_muon_adjust_lr */
} df_adam;
/* Whether Muon updates tensor `ti` (speculators' split: 2-D, both sides > 1, no codebook). */
bool df_muon_takes(const df_tensor_info *ti);
/* The factor of the Muon step of a [rows, cols] matrix over the learning rate, for
 * dflash_muon_adjust_lr `adjust` (the CPU and CUDA steps share it). */
double df_muon_lr_scale(int32_t adjust, int64_t rows, int64_t cols);
/* One Muon update of matrix p [rows, cols] from its (clipped) gradient, its momentum buffer
 * `buf` updated in place (optim_muon.c). Fails only for memory. */
DF_MUST_CHECK dflash_status df_muon_update(df_pool *pool, float *p, const float *grad, float *buf,
                                           int64_t rows, int64_t cols, const df_adam *a);

/* AdamW's per-step float constants, shared by every backend so they agree. */
typedef struct df_adam_consts {
  float decay, b1, b2, eps, step_size, bc2_sqrt;
} df_adam_consts;
void df_adam_constants(const df_adam *a, df_adam_consts *k);
/* torch.nn.utils.clip_grad_norm_'s factor (1 when clipping is off or the
 * norm is already small enough). */
double df_clip_coef(double clip, double norm);

typedef struct df_backend df_backend;

typedef struct df_backend_vt {
  const char *name;
  void (*destroy)(df_backend *b);
  dflash_status (*zero_grad)(df_backend *b);
  /* Add grad_scale * d(sum w*CE) to the gradients; return sum(w*CE), sum(w). With a
   * collect entry and loss_sum NULL the call need not wait for the device: the sums (and a
   * non-finite hidden row found on the device) come from collect. */
  dflash_status (*accumulate)(df_backend *b, const df_seq *s, double grad_scale, double *loss_sum,
                              double *weight_sum);
  /* NULL, or: the sums of the accumulates since the last collect that passed loss_sum NULL
   * (added to *loss_sum, *weight_sum); the first non-finite hidden row among them fails,
   * naming its sample. */
  dflash_status (*collect)(df_backend *b, double *loss_sum, double *weight_sum);
  /* accumulate takes df_seq's stored rows (the others get float32 hidden). */
  bool stored_rows;
  dflash_status (*predict)(df_backend *b, const df_seq *s, int32_t *pred);
  /* Global-norm clip + AdamW. With several ranks (the trainer's comm) the
   * gradients are first summed over the ranks, so the norm is global.
   * *grad_norm gets the pre-clip norm; a non-finite norm leaves everything
   * unchanged and fails. */
  dflash_status (*step)(df_backend *b, const df_adam *a, double *grad_norm);
  /* NULL, or: step may be called with grad_norm NULL, and then need not wait for the device
   * (the update is enqueued; what reads the parameters next is ordered behind it); this
   * returns that step's pre-clip norm, waiting for it, and fails for a non-finite one (the
   * step then changed nothing). */
  dflash_status (*step_result)(df_backend *b, double *grad_norm);
  /* Copy buffer `kind` between the device and the trainer's host buffer. */
  dflash_status (*pull)(df_backend *b, df_buf_kind kind, float *host);
  dflash_status (*push)(df_backend *b, df_buf_kind kind, const float *host);
} df_backend_vt;

struct df_backend {
  const df_backend_vt *vt;
  unsigned stale; /* df_buf_kind bits whose host copy is out of date */
  /* Kinds a pull leaves out of this rank's host buffer (it only takes part in
   * the gather; `stale` clears as on every rank, so the ranks' pulls stay
   * matched): the optimizer state reaches rank 0 alone, which writes it. */
  unsigned not_on_host;
};

/* The float32 reference on the CPU (trainer's own buffers, df_model). */
DF_MUST_CHECK dflash_status df_backend_cpu_create(dflash_trainer *t, df_backend **out);
/* cuda/: bf16 on the GPU with fp32 masters; DFLASH_E_UNSUPPORTED in a build
 * without CUDA, DFLASH_E_NO_DEVICE without a usable device. */
DF_MUST_CHECK dflash_status df_backend_cuda_create(dflash_trainer *t, df_backend **out);
/* The sequences per GPU per optimizer step a run takes when its options ask for none
 * (batch_size 0): 1 on the CPU; on CUDA df_cu_auto_sequences (train/cuda/dfcuda.h) for `world`
 * ranks on this rank's device (LOCAL_RANK), which it reads. `note` gets a line saying what
 * was chosen and why. CUDA's errors as df_backend_cuda_create's. */
DF_MUST_CHECK dflash_status df_backend_auto_sequences(int32_t backend, int world, int32_t *out,
                                                      char *note, size_t note_len);
DF_MUST_CHECK dflash_status df_backend_cuda_auto_sequences(int world, int32_t *out, char *note,
                                                           size_t note_len);
/* The start-up line on how this rank's GPU (`device`, as df_cu_device_props read it)
 * reaches the others of `world` ranks: P2P to each other visible device, NCCL's version and
 * the NCCL_* settings in effect (read through `env`, getenv's signature), then what a box
 * with several ranks lacks: a device without P2P, and on PCIe GPUs (df_cu_arch_pcie) the
 * NCCL_MIN_NCHANNELS and NCCL_P2P_LEVEL docs/gpu.md gives. */
struct df_cu_props;
void df_link_note(const struct df_cu_props *p, int device, int world,
                  const char *(*env)(const char *), char *out, size_t len);
/* The properties of CUDA device `device` (dfcuda.h df_cu_device_props); DFLASH_E_UNSUPPORTED
 * without CUDA in the build. */
DF_MUST_CHECK dflash_status df_backend_cuda_props(int device, struct df_cu_props *out);
/* This rank's line (LOCAL_RANK's device); CUDA's errors as df_backend_cuda_create's. */
DF_MUST_CHECK dflash_status df_backend_cuda_link_note(int world, char *out, size_t len);
/* The CUDA module's description of model m (backend_cuda.c): shapes, rotary tables, layer
 * windows, DFlash 2 and the tensor offsets (written to `offsets`, m->n_tensors of them). The
 * placement (device, rank; world 1), buckets, overlap and position weights are the caller's. */
struct df_cu_config;
void df_cu_config_of(const df_model *m, size_t *offsets, struct df_cu_config *out);

/* Bring host buffers `kinds` (df_buf_kind bits) up to date / send them to
 * the device. Callable on a const trainer: the host buffers are a cache. */
DF_MUST_CHECK dflash_status df_trainer_pull(const dflash_trainer *t, unsigned kinds);
DF_MUST_CHECK dflash_status df_trainer_push(const dflash_trainer *t, unsigned kinds);

/* Activation-layout sizes for one call of `anchors` blocks over `seq_len`
 * context positions (plan.c); chunk is clamped to the vocabulary. */
void df_plan_dims(const dflash_drafter_config *c, int64_t seq_len, int64_t anchors, int64_t chunk,
                  df_act_dims *d);

#endif
