#!/usr/bin/env python3
"""Performance model of one CUDA training step of a DFlash drafter.

Lists every GEMM, kernel, copy and collective that cuda/model.cu, cuda/kernels.cu,
cuda/attention.cu and src/train/cuda/backend_cuda.c issue for one step (accumulate one
or more sequences, then the AdamW step), with its FLOPs and HBM bytes, and a
predicted time per op from stated data about the GPU:

  * GEMMs (cuBLAS bf16, fp32 accumulate): a roofline of FLOPs at GEMM_EFF of the
    dense peak times a shape factor (wave quantization over the SMs with 128x256
    output tiles, and K / (K + 128) for the prologue and epilogue of a short
    reduction), and bytes at MEM_EFF of the HBM bandwidth; the slower of the two.
  * memory-bound kernels, copies and memsets: their bytes at MEM_EFF of the HBM
    bandwidth (each tensor read or written once: L1/L2 reuse inside a kernel is
    assumed, none across kernels).
  * attention (cuda/attention.cu, mma.sync FlashAttention-2): the FLOPs its tiles compute
    (full 16-row by 16-key tiles, so padding and masked entries cost), at the GPU's mma.sync
    ceiling, the ldmatrix traffic through shared memory at 128 B/clock/SM, or the
    exponentials at the SFU rate, whichever is slowest, divided by an occupancy factor
    (warps per SM / 8); the old scalar-FP32 kernels (--attention scalar) by a
    shared-memory wavefront count.
  * every launch costs LAUNCH_S more (launch latency and tail).
  * collectives (ZeRO-1: gradient reduce-scatter in fp32, weight all-gather in
    bf16): (world-1)/world of the buffer at the NCCL bus bandwidth. The reduce-scatter
    runs bucket by bucket on a communication stream during the last sequence's backward
    (cuda/model.cu issue_ready): a bucket starts once the backward has finished it and the
    one before it is done; only what runs past the backward's end counts (the NCCL
    kernels' own use of SMs and HBM during the backward is not modelled). The
    all-gather follows the optimizer.

Sequences per GPU per step: --batch, else the count the trainer picks itself (auto_batch,
train/cuda/dfcuda.h's df_cu_auto_sequences: 1, or 4 with several ranks on PCIe GPUs such as the
RTX PRO 6000), accumulated one after another with one reduce-scatter and one all-gather.

Model FLOPs (the MFU numerator) count what training must compute: forward and
both backward products of every trainable GEMM (fc and the LM head: no
d(input) / no d(weight) respectively, as the backend does), attention forward
over the visible keys plus twice that for its backward; recomputation, masked
work and padding are not model FLOPs.

  bench/gpu_model.py qwen3-8b|kimi|CONFIG.json [--gpu H200|B200|B300|RTX-PRO-6000]
      [--seq-len 3072] [--anchors 512] [--batch N] [--world 8] [--vocab-chunk 16384]
      [--attention mma|scalar|both] [--busbw GB/S] [--json] [--ops]

Python 3 standard library only. The emulated CI run uses the same code at tiny
shapes (bench/gpu_check.sh with DFLASH_GPU_CHECK_EMU=1).
"""
import argparse
import json
import re
import sys

# ---- stated data ----------------------------------------------------------------------
# Dense (no 2:4 sparsity) bf16 tensor-core peak with fp32 accumulation, FP32 CUDA-core
# peak, HBM bandwidth, memory, SM count, and the NCCL bus bandwidth assumed for
# reduce-scatter / all-gather inside one 8-GPU node. smem_block / smem_sm: shared memory
# per block (opt-in) / per SM (CUDA C++ Programming Guide, compute capability table:
# 227 / 228 KB on sm_90 and sm_100, 99 / 100 KB on sm_120); smem_bw: SMs x 128 B/clock
# x the clock at which the tensor peak is quoted (peak / (SMs x dense FLOP/clock/SM));
# mma_sync: the fraction of the dense peak warp-level mma.sync (cuda/attention.cu's kernels)
# can reach - assumed: Hopper's and datacenter Blackwell's full rate needs wgmma /
# tcgen05, which mma.sync does not use; sm_120 has no such path. clock: the clock of the
# tensor peak; sfu: ex2 per clock per SM; threads_sm: resident threads per SM.
GPUS = {
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 Tensor Core 1,979 TFLOPS
    # "with sparsity" -> 989.5 dense; TF32 Tensor Core 989 "with sparsity" -> 494.75 dense
    # (tf32; the other GPUs' is assumed half their bf16 peak, tf32_peak); FP32 67 TFLOPS; 141 GB HBM3e at 4.8 TB/s; NVLink
    # 900 GB/s (both directions). 132 SMs (GH100 as in the H100 SXM5). NCCL bus
    # bandwidth: 360 GB/s assumed (80 % of the 450 GB/s one direction of NVLink 4).
    # L2: 50 MB (GH100 as in the H100 SXM5, NVIDIA H100 Tensor Core GPU Architecture
    # whitepaper); L2 bandwidth 5.5 TB/s assumed (no datasheet figure; microbenchmarks of
    # the H100 SXM's L2 report about that).
    "H200": dict(peak=989.5e12, tf32=494.75e12, fp32=67e12, bw=4.8e12, mem=141e9, sms=132, busbw=360e9,
                 l2=50e6, l2bw=5.5e12, smem_block=232448, smem_sm=233472,
                 smem_bw=132 * 128 * 1.83e9, mma_sync=0.65, clock=1.83e9, sfu=16,
                 threads_sm=2048, source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)"),
    # NVIDIA HGX B200 datasheet (per GPU of the 8-GPU board, 1000 W): BF16 Tensor Core
    # 4.5 PFLOPS with sparsity -> 2.25 PFLOPS dense; FP32 80 TFLOPS; 1.44 TB HBM3e per
    # board (180 GB per GPU) at 8 TB/s; NVLink 5 1.8 TB/s (both directions). 148 SMs.
    # NCCL bus bandwidth: 720 GB/s assumed (80 % of 900 GB/s one direction).
    # L2 126 MB and 10 TB/s assumed (no datasheet figure).
    "B200": dict(peak=2250e12, fp32=80e12, bw=8.0e12, mem=180e9, sms=148, busbw=720e9,
                 l2=126e6, l2bw=10e12, smem_block=232448, smem_sm=233472,
                 smem_bw=148 * 128 * 1.86e9, mma_sync=0.5, clock=1.86e9, sfu=16,
                 threads_sm=2048, source="NVIDIA HGX B200 datasheet (per GPU)"),
    # B300 SXM (Blackwell Ultra, sm_103; NVIDIA's datasheet): dense BF16 2.25
    # PFLOPS as the B200, 288 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (NCCL bus bandwidth
    # 720 GB/s assumed as for the B200), doubled SFU ex2 rate (32 per clock per SM). 160 SMs
    # (NVIDIA's Blackwell Ultra technical blog); the clock is the peak over 160 SMs x 8192
    # dense FLOP/clock (a derived guess); L2 and its bandwidth assumed as the B200's.
    "B300": dict(peak=2250e12, fp32=80e12, bw=8.0e12, mem=288e9, sms=160, busbw=720e9,
                 l2=126e6, l2bw=10e12, smem_block=232448, smem_sm=233472,
                 smem_bw=160 * 128 * 1.717e9, mma_sync=0.5, clock=1.717e9, sfu=32,
                 threads_sm=2048, source="B300 figures of NVIDIA's published datasheets"),
    # NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet and the RTX Blackwell
    # GPU architecture whitepaper: 503.8 TFLOPS dense FP16/BF16 tensor with FP32
    # accumulate (1007.6 sparse); FP32 125 TFLOPS; 96 GB GDDR7 at 1792 GB/s; 188 SMs;
    # no NVLink: PCIe Gen 5 x16 (64 GB/s one direction). NCCL bus bandwidth of 8 of them
    # over PCIe: 25 GB/s by default (--busbw; 15-42 measured on such boxes: 22 with NCCL's
    # default 2 channels on dual EPYC, 38-41 tuned or behind PCIe switches with
    # NCCL_MIN_NCHANNELS=8; NVIDIA's datasheet). 48 warps (1536 threads) per SM.
    # L2 128 MB (GB202); L2 bandwidth 5 TB/s assumed.
    "RTX-PRO-6000": dict(peak=503.8e12, fp32=125e12, bw=1.792e12, mem=96e9, sms=188,
                         busbw=25e9, l2=128e6, l2bw=5e12, smem_block=101376,
                         smem_sm=102400, smem_bw=188 * 128 * 2.617e9, mma_sync=0.9,
                         clock=2.617e9, sfu=16, threads_sm=1536, pcie=True,
                         source="NVIDIA RTX PRO 6000 Blackwell datasheet / RTX Blackwell whitepaper"),
}

# The trainer's own choice of sequences per GPU per optimizer step when none is asked for
# (dflash_train_run_options.batch_size 0, `dflash train` without --batch): 1, or
# PCIE_SEQUENCES with several ranks on GPUs without NVLink (the `pcie` rows). The rule is
# train/cuda/dfcuda.h's df_cu_auto_sequences, DF_CU_PCIE_SEQUENCES the count (4: the smallest at
# which this model predicts >= 50 % MFU for the Kimi and Qwen3-8B drafters on 8 RTX PRO 6000
# at 25 GB/s); tests/gpu/test_gpu_model.py reads the header and checks the two agree.
PCIE_SEQUENCES = 4


def auto_batch(gpu_name, world):
    """Sequences per GPU per step the trainer picks on `world` GPUs of this kind."""
    return PCIE_SEQUENCES if world > 1 and GPUS[gpu_name].get("pcie") else 1


# ---- stated efficiencies (assumptions; gpu_check.sh prints measured next to them) -------
GEMM_EFF = 0.75      # cuBLAS bf16 GEMM at large shapes, fraction of the dense peak
GEMM_TILE = (128, 256)
MEM_EFF = 0.80       # streaming kernels, fraction of the HBM bandwidth
LAUNCH_S = 4e-6      # per kernel launch / cuBLAS call
NCCL_LAT_S = 20e-6   # per NCCL collective call inside one node (ring / NVLS start-up)
HOST_CHECK_BW = 5e9  # df_model_check_inputs' isfinite scan, one host thread (3.7 GB/s
                     # measured on this project's loaded 2-core CI machine): the fp32 path
                     # before item 4 (the `before` schedule)
HOST_CONV_BW = 10e9  # the fp32 path's host fp32 -> bf16 on the thread pool (6 B/elem), ditto
HOST_COPY_BW = 8e9   # upload_batch's memcpy of the stored rows into the pinned stage, one
                     # host thread (bytes copied per second)
PCIE_BW = 50e9       # pinned host-to-device copies, PCIe Gen 5 x16
BUCKET_ELEMS = 1 << 26  # cuda/model.cuh kBucketElems
# Bytes per gradient element through the reduce-scatter: fp32, or 2 with --rs-bf16
# (grad_reduce_bf16, --grad-reduce-bf16: each bucket rounded to bf16 before NCCL, this rank's slice widened
# after it, cuda/dist.cu reduce_scatter; two more streaming kernels per bucket).
RS_BYTES = 4
ADAM_CLIP_ACTIVE = True  # the clipping rescale kernel runs (the usual case early on)
# --optimizer muon (DFLASH_OPTIMIZER_MUON): the step of cuda/backend.cu muon_step, Muon on the
# weight matrices (muon_matrices) and AdamW on the rest, instead of AdamW on everything.
MUON = False

# ---- shapes ---------------------------------------------------------------------------
BUILTIN = {
    # tests/gpu/gpu_bench.c shape("qwen3-8b") and z-lab's Qwen3-8B drafter
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                     window=[0] * 5),
    # tests/gpu/gpu_bench.c shape("kimi") and bench/gpu_check.sh's kimi.json
    "kimi": dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 vocab_size=163840, block_size=16, target_layer_ids=[1, 12, 24, 35, 47, 58],
                 window=[0] * 6),
    # the emulated check's shape (tests/gpu/gpu_bench.c shape("tiny"))
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=256, block_size=4, target_layer_ids=[0, 1], window=[0, 0]),
}


def load_config(name):
    """A built-in shape or a drafter config.json (the keys libdflash reads)."""
    if name in BUILTIN:
        return dict(BUILTIN[name], name=name)
    with open(name, encoding="utf-8") as f:
        j = json.load(f)
    L = j["num_hidden_layers"]
    ids = (j.get("dflash_config") or {}).get("target_layer_ids") or j.get("target_layer_ids")
    if not ids:
        raise SystemExit(f"{name}: no dflash_config.target_layer_ids")
    types = j.get("layer_types") or ["full_attention"] * L
    sw = j.get("sliding_window") or 0
    df2 = None
    if "DFlash2DraftModel" in (j.get("architectures") or []):  # config.c: dflash_config first
        dc = j.get("dflash_config") or {}
        v = lambda k: dc.get(k, j.get(k))
        df2 = dict(k=v("conv_kernel_size"), g=v("conv_group_size"), K=v("selector_top_k"),
                   r=v("selector_rank"))
    dsp = None
    if set(j.get("architectures") or []) & {"Qwen3DSparkModel", "DSparkDraftModel"}:
        dc = j.get("dflash_config") or {}
        v = lambda k, d: dc.get(k, j.get(k, d))
        dsp = dict(r=v("markov_rank", 256), conf=bool(v("confidence_head", True)))
        vd = v("draft_vocab_size", None)
        if vd and vd < j["vocab_size"]:  # a pruned draft vocabulary (spec/dspark.md section 4)
            dsp["vd"] = vd
    return dict(name=name, dflash2=df2, dspark=dsp, hidden_size=j["hidden_size"],
                intermediate_size=j["intermediate_size"],
                num_hidden_layers=L, num_attention_heads=j["num_attention_heads"],
                num_key_value_heads=j.get("num_key_value_heads", j["num_attention_heads"]),
                head_dim=j.get("head_dim", j["hidden_size"] // j["num_attention_heads"]),
                vocab_size=j["vocab_size"], block_size=j.get("block_size", 16),
                target_layer_ids=ids,
                window=[sw if t == "sliding_attention" else 0 for t in types])


def param_count(c):
    """Trainable parameters in model.c's tensor order (src/train/plan.c param_count)."""
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qd, kd = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = 2 * H + 2 * qd * H + 2 * kd * H + 2 * d + 3 * I * H
    n = H * len(c["target_layer_ids"]) * H + H + c["num_hidden_layers"] * layer + H
    x = c.get("dflash2")
    if x:  # per layer and convolution: base_kernel [2, k, H], kernel_projection [2kG, H];
        # then the selector's two codebooks [V, r] and hidden_projection [r, H]
        G = H // x["g"]
        n += c["num_hidden_layers"] * 2 * (2 * x["k"] * H + 2 * x["k"] * G * H)
        n += 2 * c["vocab_size"] * x["r"] + x["r"] * H
    x = c.get("dspark")
    if x:  # the Markov head's W1 [V, r], W2 [V_d, r]; the confidence head [H + r] and its bias
        n += (c["vocab_size"] + draft_vocab(c)) * x["r"] + ((H + x["r"] + 1) if x["conf"] else 0)
    return n


def draft_vocab(c):
    """DSpark's draft vocabulary V_d: its `vd` when pruned, else the vocabulary."""
    return (c.get("dspark") or {}).get("vd") or c["vocab_size"]


def df2_conv_forward(c, s, p, which):
    """cuda/dflash2.cu df2_prepare (`which` 0: attention, 1: MLP): the dynamic kernels of the
    sublayer's normed input (a GEMM into fp32 [T, 2kG]) and its convolution."""
    x, T, H = c["dflash2"], s.T, c["hidden_size"]
    kG = x["k"] * (H // x["g"])
    return [gemm(p + f"conv {which} kernel projection (fp32 out)", T, 2 * kG, H, c_bytes=4),
            mem(p + f"conv {which} prepare (convolve the input)", "df2_conv_apply",
                2 * 2 * T * H + 4 * T * kG + 2 * x["k"] * H, flops=2.0 * T * H * x["k"])]


def df2_conv_finish(c, s, p, which):
    """df2_finish: out = residual + the convolution of the sublayer's output y."""
    x, T, H = c["dflash2"], s.T, c["hidden_size"]
    kG = x["k"] * (H // x["g"])
    return [mem(p + f"conv {which} finish (+ residual)", "df2_conv_apply",
                3 * 2 * T * H + 4 * T * kG + 2 * x["k"] * H, flops=2.0 * T * H * x["k"])]


def df2_conv_backward(c, s, p, what, dy_bytes, dx_bytes):
    """cuda/dflash2.cu conv_backward: d(input), d(dynamic kernels), d(base kernel)."""
    x, T, H = c["dflash2"], s.T, c["hidden_size"]
    kG, seg = x["k"] * (H // x["g"]), min(64, -(-T // 256))
    return [mem(p + f"{what} dx", "df2_conv_backward_dx", T * H * (dy_bytes + dx_bytes) + 4 * T * kG,
                flops=2.0 * T * H * x["k"]),
            mem(p + f"{what} d(dynamic kernels)", "df2_conv_backward_ddyn",
                T * H * (dy_bytes + 2) + 4 * T * kG, flops=2.0 * T * H * x["k"]),
            mem(p + f"{what} d(base kernel)", "df2_conv_backward_dbase_partial+df2_conv_backward_dbase_reduce",
                T * H * (dy_bytes + 2) + 2 * 4 * seg * x["k"] * H, launches=2)]


def df2_layer_backward(c, s, p, which):
    """df2_finish_bwd then df2_prepare_bwd of one sublayer (the sublayer's own GEMMs between)."""
    x, T, H = c["dflash2"], s.T, c["hidden_size"]
    kg2 = 2 * x["k"] * (H // x["g"])
    fin = df2_conv_backward(c, s, p, f"conv {which} finish^T", 2, 2)
    prep = df2_conv_backward(c, s, p, f"conv {which} prepare^T", 4, 4)
    prep += [mem(p + f"conv {which} d(kernels) to bf16", "f32_to_bf16", 6 * T * kg2),
             gemm(p + f"conv {which} kernel projection dx (+=)", T, H, kg2, c_bytes=4, beta=1.0),
             gemm(p + f"conv {which} kernel projection dw", kg2, H, T, c_bytes=4, beta=1.0)]
    return fin, prep


def df2_selector_ops(c, s, chunk):
    """cuda/dflash2.cu: the selector's top-K inside the CE pass, then df2_selector (scores,
    CE, d(score)) and its gradients; the codebooks' d(W) are dense GEMMs over the sparse
    [R, chunk] matrix per vocabulary chunk (model FLOPs: only its nonzeros)."""
    x, R, H, V = c["dflash2"], s.R, c["hidden_size"], c["vocab_size"]
    K, r = x["K"], x["r"]
    nchunk = -(-V // chunk)
    ops = [mem("selector top-K reset", "df2_lmhead_topk_init", 8 * R * K),
           mem(f"selector top-K merge ({nchunk} chunks, beside lmhead_ce_chunk)", "df2_lmhead_topk_chunk",
               4 * R * V + nchunk * 8 * R * K, launches=nchunk),
           Op("selector previous tokens (H2D)", "cudaMemcpyAsync", "h2d", 0, 4 * R),
           mem("selector target logit", "df2_selector_target_logit", 2 * 2 * R * H + 4 * R,
               flops=2.0 * R * H),
           gemm("selector hidden projection (fp32 out)", R, r, H, c_bytes=4),
           mem("selector scores, CE, d(score) per row", "df2_selector_row",
               2 * R * K * H + 2 * 2 * R * K * r + 4 * R * (H + 3 * r),
               flops=2.0 * R * K * (r + H)),
           gemm("selector hidden projection dw", r, H, R, c_bytes=4, beta=1.0),
           gemm("selector d(rows) through the projection", R, H, r, c_bytes=4, beta=1.0),
           mem("selector d(rows) into the CE's", "df2_add_rows", R * H * (4 + 2 + 2))]
    for cb, nz in (("successor", K), ("predecessor", 1)):
        ops += [mem(f"selector {cb} codebook: clear the sparse chunk ({nchunk} chunks)",
                    "cudaMemsetAsync", 2 * R * V, launches=nchunk),
                mem(f"selector {cb} codebook: scatter d(score)", "df2_selector_scatter_chunk",
                    nchunk * (2 * R * nz + 8 * R * nz), launches=nchunk)]
        g = gemm(f"selector {cb} codebook dw ({nchunk} chunks, dense over the sparse chunk)", V,
                 r, R, c_bytes=4, beta=1.0, model=False, call=(min(chunk, V), r, R))
        g.model_flops, g.launches = 2.0 * R * nz * r, nchunk
        ops.append(g)
    return ops


def anchors_for(seq_len, n, B):
    """Anchors as tests/gpu/gpu_bench.c draws them, in expectation: a uniform subset
    of the candidates p in [len/8 + 1, len - B] (the prompt has no loss), here the
    n evenly spaced quantiles."""
    lo, hi = seq_len // 8 + 1, seq_len - B
    n = max(0, min(n, hi - lo + 1))
    return [int(lo + (i + 0.5) * (hi - lo + 1) / n) for i in range(n)]


class Seq:
    """Per-sequence sizes the backend derives (backend_cuda.c prepare())."""

    def __init__(self, c, seq_len, n_anchors):
        B = c["block_size"]
        self.anchors = anchors_for(seq_len, n_anchors, B)
        self.A = len(self.anchors)
        self.T = self.A * B
        self.Sc = max(self.anchors) if self.anchors else 0
        # DSpark's block is anchor-first with labels shifted by one: every slot is supervised
        first = 0 if c.get("dspark") else 1
        self.R = sum(1 for a in self.anchors for j in range(first, B) if a + j < seq_len)
        self.len = seq_len


# ---- ops ------------------------------------------------------------------------------
class Op:
    __slots__ = ("name", "kernel", "kind", "flops", "bytes", "model_flops", "launches",
                 "count", "extra")

    def __init__(self, name, kernel, kind, flops=0.0, nbytes=0.0, model_flops=0.0,
                 launches=1, count=1, extra=None):
        self.name, self.kernel, self.kind = name, kernel, kind
        self.flops, self.bytes, self.model_flops = flops, nbytes, model_flops
        self.launches, self.count, self.extra = launches, count, extra or {}


def gemm(name, M, N, K, a_bytes=2, c_bytes=2, beta=0.0, model=True, count=1, call=None):
    """C[M,N] (+)= A[M,K] B[K,N] on cuBLAS: bf16 operands, bf16 or fp32 C. `call`: the
    shape of one cuBLAS call when the op is several (the LM head's vocabulary chunks)."""
    fl = 2.0 * M * N * K
    by = a_bytes * (M * K + K * N) + c_bytes * M * N * (2 if beta else 1)
    return Op(name, "cublasGemmEx", "gemm", fl, by, fl if model else 0.0, 1, count,
              dict(M=M, N=N, K=K, c_bytes=c_bytes, beta=beta, call=call or (M, N, K)))


def mem(name, kernel, nbytes, launches=1, count=1, flops=0.0):
    return Op(name, kernel, "mem", flops, nbytes, 0.0, launches, count)


def rmsnorm_forward(name, rows, n):   # rmsnorm_forward: x in, y out (bf16), rstd (f32)
    return mem(name, "rmsnorm_forward", 2 * rows * n * 2 + 4 * rows + 2 * n, flops=4.0 * rows * n)


def rms_dw(name, rows, n, dy_bytes):  # rmsnorm_backward_dw_partial + rmsnorm_backward_dw_reduce
    splits = min(256, (rows + 63) // 64)
    return mem(name, "rmsnorm_backward_dw_partial+rmsnorm_backward_dw_reduce",
               rows * n * (dy_bytes + 2) + 4 * rows + 4 * splits * n * 2 + 8 * n, launches=2)


def rmsnorm_backward(name, rows, n, dy_bytes, dx_bytes, acc):
    return mem(name, "rmsnorm_backward", rows * n * (dy_bytes + 2 + dx_bytes * (2 if acc else 1)) +
               4 * rows + 2 * n, flops=6.0 * rows * n)


def rope(name, rows, heads, d):  # in place, bf16, tables f32 (cached)
    return mem(name, "rope_forward", 2 * 2 * rows * heads * d + 4 * rows * d, flops=3.0 * rows * heads * d)


def visible_keys(c, s, window):
    """Visible (query, key) pairs per query head summed over blocks, for one layer,
    and the block list of (context keys visible to some query, first context key)."""
    B, pairs = c["block_size"], 0
    for a in s.anchors:
        nctx = min(a, s.Sc)
        for j in range(B):
            if window <= 0:
                pairs += nctx + B
            else:
                lo = max(0, a + j - (window - 1))
                pairs += max(0, nctx - lo) + min(j, window - 1) + 1
    return pairs


def key_span(c, s, window):
    """Keys each block's CTA walks: from the first context key any query sees to the
    block's end (attention.cu ctx_lo .. nctx + B)."""
    B, spans = c["block_size"], []
    for a in s.anchors:
        nctx = min(a, s.Sc)
        lo = 0 if window <= 0 else max(0, a - (window - 1))
        spans.append(nctx + B - min(lo, nctx))
    return spans


class Unsupported(Exception):
    """A shape the CUDA backend refuses on this GPU."""


def row_len(dp):
    """cuda/attention.cu row_len(): shared rows unpadded (XOR-swizzled) when dp is a multiple
    of 64, else padded by 8 elements."""
    return dp if dp % 64 == 0 else dp + 8


def smem_layout(kind, Mp, N, d):
    """cuda/attention.cu smem_layout(): bytes of one CTA's shared memory (head_dim d
    zero-padded to dp, a multiple of 16): Q (and dO) rows, K and V tiles, and the kv pass's
    lse / D rows."""
    dp = -(-d // 16) * 16
    ld = row_len(dp)
    up = lambda x: (x + 127) // 128 * 128
    regions = [2 * Mp * ld] + ([] if kind == "fwd" else [2 * Mp * ld]) + [2 * N * ld] * 2
    regions += [4 * Mp, 4 * Mp] if kind == "bwd_kv" else []
    return sum(up(x) for x in regions)


def pick_n(kind, Mp, d, limit):
    """cuda/attention.cu pick_n(): the widest key tile (64, 32, 16) that fits."""
    for N in (64, 32, 16):
        if smem_layout(kind, Mp, N, d) <= limit:
            return N
    return 0


def kv_groups(Mp, N, dp):
    """cuda/attention.cu kv_groups(): attention_backward_kv's row groups (2: 8 warps at N 64)
    when N x dp fp32 partial sums fit over the Q and dO rows and Mp >= 64."""
    return 2 if N * dp <= Mp * row_len(dp) and Mp >= 64 else 1


def mma_kernel_time(o, gpu):
    """Tensor-core FLOPs at the mma.sync ceiling, ldmatrix traffic through shared memory
    (SMs x 128 B/clock) and the exponentials on the SFUs (ex2 per clock per SM), the
    slowest of the three, slowed by low occupancy (fewer than 8 warps per SM leave the
    tensor pipes idle across barriers and ldmatrix latency); HBM and L2 traffic overlap."""
    x = o.extra
    occ = min(1.0, x["ctas_per_sm"] * x["warps"] / 8.0)
    tc = o.flops / (gpu["peak"] * gpu["mma_sync"])
    sm = x["smem_traffic"] / gpu["smem_bw"]
    sfu = x["exps"] / (gpu["sms"] * gpu["sfu"] * gpu["clock"])
    busy = max(tc, sm, sfu) / occ
    x["eff"] = o.model_flops / busy / gpu["peak"] if o.flops else 0.0
    return max(busy, o.bytes / (gpu["bw"] * MEM_EFF), x["l2"] / gpu["l2bw"])


# cuda/attention.cu's kernels, named after df_attention_forward / df_attention_backward.
ATTN_KERNEL = {"fwd": "attention_forward", "bwd_q": "attention_backward_q",
               "bwd_kv": "attention_backward_kv"}


def ldsm_bytes(w, dp):
    """Shared-memory bytes per tensor-core FLOP of one warp's product of 16 rows by w
    columns over dp (cuda/attention.cu scores()): per 16-wide k step one 512-byte A fragment
    and a 512-byte B fragment per 16 columns (2 mma.sync m16n8k16, 8192 FLOPs); a product
    whose A comes from registers (P V, dS K, P^T dO, dS^T Q: accumulate()) pays only its
    B, 1/16 B/FLOP."""
    return 1.0 / 16 + 1.0 / w


def mma_attention(c, s, l, gpu, w, fwd_model, io):
    """cuda/attention.cu as documented at its top (FlashAttention-2 on mma.sync): one CTA
    per (block, kv head) packs M = B x nh/nkv query rows (padded to 16), a warp per 16
    rows; keys walk in tiles of N (the widest of 64, 32, 16 whose shared memory fits),
    context tiles from the first visible row, then the block's own keys; a tile of cnt keys
    costs 16 * ceil(cnt / 16) columns at the full Mp. attention_backward_q: S, dP, dQ per
    tile; attention_backward_kv: one CTA per (N keys, kv head), a warp per 16 keys, over the
    blocks that see them (context tiles; each block's own keys): S^T, dP^T, dK, dV."""
    B, d, nh, nkv = c["block_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk = -(-d // 16) * 16  # the products run over head_dim padded to 16
    grp = nh // nkv
    M = B * grp
    Mp = -(-M // 16) * 16
    ops, kv_bytes = [], 2 * 2 * s.Sc * nkv * d
    in_l2 = kv_bytes <= gpu["l2"] / 2
    spans_ctx = []
    for a in s.anchors:
        nctx = min(a, s.Sc)
        lo = 0 if w <= 0 else max(0, a - (w - 1))
        spans_ctx.append((min(lo, nctx), nctx))
    w16 = lambda k: -(-k // 16) * 16  # a tile of k keys costs w16(k) columns
    q_bytes = 2 * s.T * nh * d
    for kind in ("fwd", "bwd_q", "bwd_kv"):
        N = pick_n(kind, Mp, d, gpu["smem_block"])
        if not N:
            raise Unsupported(f"CUDA attention {kind}: {Mp} rows x head_dim {d} need "
                              f"{smem_layout(kind, Mp, 16, d)} bytes of shared memory even at "
                              f"N 16, more than the {gpu['smem_block']} per block of this GPU: "
                              f"the backend refuses this shape (DFLASH_E_UNSUPPORTED)")
        smem = smem_layout(kind, Mp, N, d)
        W = N // 16 * kv_groups(Mp, N, dk) if kind == "bwd_kv" else Mp // 16
        ctas = max(1, min(gpu["smem_sm"] // (smem + 1024), gpu["threads_sm"] // (32 * W)))
        # keys: the sum of the tile widths each CTA visits (attention.cu's FLOPs header)
        ctx_keys = sum((hi - lo) // N * N + w16((hi - lo) % N) for lo, hi in spans_ctx)
        blk_keys = s.A * (B // N * N + w16(B % N))
        keys = ctx_keys + blk_keys
        if kind == "fwd":
            fl = nkv * 4.0 * Mp * keys * dk
            wt = min(N, w16(B)) if keys == blk_keys else N
            traffic = nkv * 2.0 * Mp * dk * keys * (ldsm_bytes(wt, dk) + 1.0 / 16)
            exps = nkv * Mp * keys
            l2 = nkv * keys * d * 2 * 2  # each CTA's K and V tiles through L2
            hbm = 2 * q_bytes + 4 * s.T * nh + 2 * 2 * s.T * nkv * d + (kv_bytes if in_l2 else nkv * keys * d * 4)
            name, mf = f"L{l} attention fwd (mma.sync, M {M}, N {N})", fwd_model
        elif kind == "bwd_q":
            fl = nkv * 6.0 * Mp * keys * dk
            traffic = nkv * 2.0 * Mp * dk * keys * (2 * ldsm_bytes(N, dk) + 1.0 / 16)
            exps = nkv * Mp * keys
            l2 = nkv * keys * d * 2 * 2
            hbm = 4 * q_bytes + 8 * s.T * nh + 2 * 2 * s.T * nkv * d + (kv_bytes if in_l2 else nkv * keys * d * 4)
            name, mf = f"L{l} attention bwd dQ (mma.sync, N {N})", fwd_model
        else:
            pairs = cols = 0
            for t0 in range(0, s.Sc, N):
                cnt = min(N, s.Sc - t0)
                for lo, hi in spans_ctx:
                    if t0 < hi and t0 + cnt > lo:
                        pairs += 1
                        cols += w16(min(hi - t0, cnt))
            pairs += s.A * -(-B // N)  # each block's own keys
            cols += s.A * (B // N * N + w16(B % N))
            fl = nkv * 8.0 * Mp * cols * dk
            # S^T, dP^T: A = K / V rows (16 keys), B = 32 query rows per step; dV, dK: B only
            traffic = nkv * 2.0 * Mp * dk * cols * 2 * (ldsm_bytes(32, dk) + 1.0 / 16)
            exps = nkv * Mp * cols
            l2 = nkv * pairs * (Mp * d * 2 * 2 + 8 * Mp)  # q, dO, lse, D per (tile, block)
            waves = -(-(-(-s.Sc // N) * nkv) // (gpu["sms"] * ctas))
            hbm = waves * (2 * q_bytes + 8 * s.T * nh) + 2 * kv_bytes + 2 * 2 * s.T * nkv * d
            name, mf = f"L{l} attention bwd dK/dV (mma.sync, N {N})", fwd_model
        ops.append(Op(name, ATTN_KERNEL[kind], "attn", fl, hbm, mf,
                      extra=dict(mma=True, warps=W, ctas_per_sm=ctas, smem=smem, N=N, M=M,
                                 smem_traffic=traffic, exps=exps, l2=l2)))
    return ops


def attention_ops(c, s, l, gpu, design):
    """Forward and backward attention of layer l: model FLOPs, executed FLOPs, bytes."""
    B, d, nh, nkv = c["block_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    w = c["window"][l]
    pairs = visible_keys(c, s, w)             # per query head
    fwd_model = 4.0 * pairs * d * nh          # QK^T and PV
    spans = key_span(c, s, w)
    io = 2 * d * (s.T * nh * 2 + s.Sc * nkv * 2 + s.T * nkv * 2)  # q,o + kc,vc + kb,vb
    if design in ("mma", "wmma"):  # "wmma": the former name of the tensor-core path
        return mma_attention(c, s, l, gpu, w, fwd_model, io)
    # Current scalar kernels: FMAs on CUDA cores, limited by shared-memory wavefronts.
    # dot_fb (q.k, dO.v): per warp FMA one broadcast q load + the k row load, 8-way
    # bank-conflicted (8 lanes of a row read 8 keys 2*d bytes apart): 9 wavefronts per
    # 32 FMAs. Accumulations (p*v, ds*k, dk/dv sums): ~2 wavefronts per 32 FMAs.
    dot_rate = gpu["fp32"] / 2 / 128 * 32 / 9  # FMA/s: sms*clock*32 lanes/9 wavefronts
    acc_rate = gpu["fp32"] / 2 / 128 * 32 / 2
    kt = 64
    padded = sum(-(-k // kt) * kt for k in spans) * B * nh  # q rows x keys (fwd walk)
    vis = pairs * nh
    fwd_t = vis * d / dot_rate + vis * d / acc_rate
    fwd = Op(f"L{l} attention fwd (scalar fp32)", "attention_forward", "attn", 4.0 * vis * d,
             io + 2 * 2 * d * nh * sum(spans), fwd_model, extra=dict(time=fwd_t))
    # attention_backward_block: 2 dots (visible) + dq accumulation over every walked key + block
    # dk/dv; attention_backward_ctx: 2 dots + 2 accumulations per visible context pair.
    ctx_pairs = sum(max(0, k - B) for k in spans) * B * nh
    blk_t = 2 * vis * d / dot_rate + padded * d / acc_rate + 2 * s.A * nh * B * B * d / acc_rate
    ctx_t = 2 * ctx_pairs * d / dot_rate + 2 * ctx_pairs * d / acc_rate
    b1 = Op(f"L{l} attention bwd dq + block dk/dv (scalar)", "attention_backward_block", "attn",
            2.0 * (3 * vis + 2 * s.A * nh * B * B) * d, 2 * io, fwd_model,
            extra=dict(time=blk_t))
    b2 = Op(f"L{l} attention bwd context dk/dv (scalar)", "attention_backward_ctx", "attn",
            8.0 * ctx_pairs * d, io, fwd_model, extra=dict(time=ctx_t))
    return [fwd, b1, b2]


def layer_forward(c, s, l, gpu, design):
    T, Sc, H, I = s.T, s.Sc, c["hidden_size"], c["intermediate_size"]
    d, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    qd, kd = nh * d, nkv * d
    p = f"L{l} fwd "
    ops = [rmsnorm_forward(p + "input norm", T, H),
           gemm(p + "q proj", T, qd, H), rmsnorm_forward(p + "q norm", T * nh, d), rope(p + "q rope", T, nh, d),
           gemm(p + "k proj (block)", T, kd, H), rmsnorm_forward(p + "k norm (block)", T * nkv, d),
           rope(p + "k rope (block)", T, nkv, d), gemm(p + "v proj (block)", T, kd, H),
           gemm(p + "k proj (context)", Sc, kd, H), rmsnorm_forward(p + "k norm (context)", Sc * nkv, d),
           rope(p + "k rope (context)", Sc, nkv, d), gemm(p + "v proj (context)", Sc, kd, H)]
    ops += [o for o in attention_ops(c, s, l, gpu, design) if o.kernel == "attention_forward"]
    if c.get("dflash2"):  # DFlash 2: the sublayers' inputs and outputs convolved
        ops[1:1] = df2_conv_forward(c, s, p, 0)
        return ops + [gemm(p + "o proj", T, H, qd)] + df2_conv_finish(c, s, p, 0) + [
            rmsnorm_forward(p + "post-attention norm", T, H)] + df2_conv_forward(c, s, p, 1) + [
            gemm(p + "gate proj", T, I, H), gemm(p + "up proj", T, I, H),
            mem(p + "SwiGLU", "swiglu_forward", 3 * 2 * T * I, flops=6.0 * T * I),
            gemm(p + "down proj", T, H, I)] + df2_conv_finish(c, s, p, 1)
    ops += [mem(p + "residual copy h_mid = h_in", "cudaMemcpyAsync", 2 * 2 * T * H),
            gemm(p + "o proj (+= residual)", T, H, qd, beta=1.0),
            rmsnorm_forward(p + "post-attention norm", T, H),
            gemm(p + "gate proj", T, I, H), gemm(p + "up proj", T, I, H),
            mem(p + "SwiGLU", "swiglu_forward", 3 * 2 * T * I, flops=6.0 * T * I),
            mem(p + "residual copy out = h_mid", "cudaMemcpyAsync", 2 * 2 * T * H),
            gemm(p + "down proj (+= residual)", T, H, I, beta=1.0)]
    return ops


def qk_backward(p, rows, heads, d, H, acc, what):
    n = rows * heads
    return [rope(p + f"{what} rope^T", rows, heads, d),
            rms_dw(p + f"{what} norm dw", n, d, 2),
            rmsnorm_backward(p + f"{what} norm dx", n, d, 2, 2, False),
            gemm(p + f"{what} proj dx", rows, H, heads * d, c_bytes=4, beta=1.0 if acc else 0.0),
            gemm(p + f"{what} proj dw", heads * d, H, rows, c_bytes=4, beta=1.0)]


def layer_backward(c, s, l, gpu, design):
    T, Sc, H, I = s.T, s.Sc, c["hidden_size"], c["intermediate_size"]
    d, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    qd, kd = nh * d, nkv * d
    p = f"L{l} bwd "
    df2 = c.get("dflash2")
    (fin1, prep1), (fin0, prep0) = (df2_layer_backward(c, s, p, 1), df2_layer_backward(c, s, p, 0)) \
        if df2 else (([], []), ([], []))
    ops = fin1 + [gemm(p + "down dx", T, I, H), gemm(p + "down dw", H, I, T, c_bytes=4, beta=1.0),
           mem(p + "SwiGLU backward", "swiglu_backward", 5 * 2 * T * I, flops=12.0 * T * I),
           gemm(p + "gate dx", T, H, I, c_bytes=4), gemm(p + "up dx (+=)", T, H, I, c_bytes=4, beta=1.0),
           gemm(p + "gate dw", I, H, T, c_bytes=4, beta=1.0),
           gemm(p + "up dw", I, H, T, c_bytes=4, beta=1.0)] + prep1 + [
           rms_dw(p + "post-attention norm dw", T, H, 4),
           rmsnorm_backward(p + "post-attention norm dx (+=)", T, H, 4, 2, True)] + fin0 + [
           gemm(p + "o dx", T, qd, H), gemm(p + "o dw", H, qd, T, c_bytes=4, beta=1.0)]
    ops += [o for o in attention_ops(c, s, l, gpu, design) if o.kernel != "attention_forward"]
    ops += qk_backward(p, T, nh, d, H, False, "q")
    ops += qk_backward(p, T, nkv, d, H, True, "k (block)")
    ops += [gemm(p + "v (block) dx (+=)", T, H, kd, c_bytes=4, beta=1.0),
            gemm(p + "v (block) dw", kd, H, T, c_bytes=4, beta=1.0)] + prep0
    ops += qk_backward(p, Sc, nkv, d, H, True, "k (context)")
    ops += [gemm(p + "v (context) dx (+=)", Sc, H, kd, c_bytes=4, beta=1.0),
            gemm(p + "v (context) dw", kd, H, Sc, c_bytes=4, beta=1.0),
            rms_dw(p + "input norm dw", T, H, 4),
            rmsnorm_backward(p + "input norm dx (+=)", T, H, 4, 2, True)]
    return ops


def sequence_ops(c, s, gpu, design, chunk):
    """One df_cu_accumulate: upload, forward, LM head + CE, backward."""
    H, V, KH = c["hidden_size"], c["vocab_size"], c["hidden_size"] * len(c["target_layer_ids"])
    T, Sc, R, A = s.T, s.Sc, s.R, s.A
    # Item 4: the rows go up as stored (bf16 here; fp8 is half the bytes plus 4 B per token
    # and layer): into a pinned stage on the host, then on the copy stream behind the
    # previous sequence's compute, decoded and checked on the device. The prefetch thread's
    # read of the codes runs beside the trainer thread and is not counted.
    ops = [Op("host: stored rows into the pinned stage (memcpy, 1 thread)", "memcpy", "host", 0,
              2 * Sc * KH, extra=dict(rate=HOST_COPY_BW)),
           Op("upload ids, rows, coefficients, anchors (H2D, pinned)", "cudaMemcpyAsync", "h2d", 0,
              4 * (A + T + 3 * R), launches=5),
           Op("upload hidden rows as stored, bf16 [Sc, KH] (H2D, copy stream)", "cudaMemcpyAsync",
              "h2d", 0, 2 * Sc * KH, extra=dict(copy_stream=True)),
           mem("hidden rows to bf16 + NaN/Inf check (device)", "hidden_decode", 4 * Sc * KH),
           mem("block positions", "positions", 8 * T + 4 * A),
           gemm("fc: context = hidden [Sc,KH] x W_fc^T", Sc, H, KH),
           rmsnorm_forward("hidden norm (context)", Sc, H),
           mem("embed block tokens", "gather_rows", 2 * 2 * T * H + 4 * T)]
    for l in range(c["num_hidden_layers"]):
        ops += layer_forward(c, s, l, gpu, design)
    ops += [rmsnorm_forward("final norm", T, H), mem("gather supervised rows", "gather_rows", 2 * 2 * R * H + 4 * R)]
    nchunk = -(-V // chunk)
    if c.get("dspark"):
        return dspark_sequence_tail(c, s, ops) + layers_backward(c, s, gpu, design)
    ops += [mem("CE init", "lmhead_ce_init", 12 * R), mem("CE grad accumulator clear", "cudaMemsetAsync", 4 * R * H),
            gemm(f"LM head logits ({nchunk} chunks, fp32 out)", R, V, H, c_bytes=4,
                 call=(R, min(chunk, V), H)),
            mem(f"CE chunk: max, exp, probs, rescale ({nchunk} chunks)", "lmhead_ce_chunk",
                V * R * (4 + 2) + nchunk * 8 * R * H, launches=nchunk, flops=4.0 * R * V),
            gemm(f"LM head d(rows) = probs x E ({nchunk} chunks, fp32 +=)", R, H, V, c_bytes=4,
                 beta=1.0, call=(R, H, min(chunk, V))),
            mem("CE finish: loss, d(rows)", "lmhead_ce_finish", R * H * (4 + 2 + 2) + 16 * R)]
    if c.get("dflash2"):
        ops += df2_selector_ops(c, s, chunk)
    ops += [
            # the backward of a step's last sequence is deferred to the step: this runs first
            mem("sequence loss sum(w*CE), kept on the device", "seq_loss", 12 * R)]
    for o in ops:
        if o.name.startswith("LM head"):
            o.launches = nchunk
    return ops + layers_backward(c, s, gpu, design)


def layers_backward(c, s, gpu, design):
    """From the rows' gradient back to the context: the final norm, the layers, fc."""
    H, KH = c["hidden_size"], c["hidden_size"] * len(c["target_layer_ids"])
    T, Sc, R = s.T, s.Sc, s.R
    ops = [mem("d(hidden) clear", "cudaMemsetAsync", 2 * T * H),
           mem("scatter d(rows)", "scatter_rows", 2 * 2 * R * H + 4 * R),
           rms_dw("final norm dw", T, H, 2), rmsnorm_backward("final norm dx", T, H, 2, 2, False),
           mem("d(context) clear", "cudaMemsetAsync", 4 * Sc * H)]
    for l in reversed(range(c["num_hidden_layers"])):
        ops += layer_backward(c, s, l, gpu, design)
    ops += [rms_dw("hidden norm dw", Sc, H, 4), rmsnorm_backward("hidden norm dx", Sc, H, 4, 2, False),
            gemm("fc dw", H, KH, Sc, c_bytes=4, beta=1.0)]
    for o in ops:
        o.extra["bwd"] = True
    return ops


DSPARK_ROWS = 64  # src/train/cuda/dfcuda.h DF_CU_DSPARK_ROWS: rows per pass over the vocabulary


def dspark_sequence_tail(c, s, ops):
    """cuda/model.cu dspark_upload + dspark_loss in place of lmhead_ce: the previous tokens
    and the target's final state up; W1's rows gathered; per pass of 64 rows the draft logits
    x E^T + e W2^T (fp32 [n, V_d]) and the target's xt E^T (fp32 [n, V], the full vocabulary
    even when pruned), the row pass (softmaxes, L1, CE, the confidence head; with grad d(z)
    in bf16 [n, V_d]), then d(x) = dz E, d(e) = dz W2, dW2 += dz^T e (V_d wide), the
    confidence head's paths and W1's sparse rows. The confidence head and L1 need the final
    state, as in the runs that train them. A pruned drafter's E is the kept rows of the
    target's head, gathered once when the kept ids are set (not a step's work)."""
    H, V, x = c["hidden_size"], c["vocab_size"], c["dspark"]
    Vd = draft_vocab(c)
    r, R = x["r"], s.R
    n = -(-R // DSPARK_ROWS)
    call = lambda N, K: (min(DSPARK_ROWS, R), N, K)
    # the row pass: the draft logits read and written (p), d(z) written, the target's read;
    # full vocabulary: the target's row written too (sign(p - q)); pruned: read again at the
    # kept ids (q renormalized over them) and the full-vocabulary logsumexp for c*
    row_bytes = (R * V * (4 * 2 * 2 + 2) if Vd == V else R * (Vd * (4 * 2 + 2 + 4) + 4 * V))
    ops += [Op("upload previous tokens and the target's final state (H2D, pageable)",
               "cudaMemcpyAsync", "h2d", 0, 4 * R + 2 * R * H, launches=2),
            mem("DSpark: W1 rows of the previous tokens", "gather_rows", 2 * 2 * R * r + 4 * R),
            gemm(f"DSpark draft logits x E^T ({n} passes, fp32 out)", R, Vd, H, c_bytes=4,
                 call=call(Vd, H)),
            gemm(f"DSpark Markov bias e W2^T ({n} passes, fp32 +=)", R, Vd, r, c_bytes=4,
                 beta=1.0, call=call(Vd, r)),
            gemm(f"DSpark target logits xt E^T ({n} passes, fp32 out)", R, V, H, c_bytes=4,
                 call=call(V, H), model=False),
            mem(f"DSpark row pass: softmaxes, CE, L1, confidence, d(z) ({n} passes)",
                "dspark_loss_rows", row_bytes + 2 * R * (H + r), launches=n,
                flops=12.0 * R * Vd + (0 if Vd == V else 2.0 * R * V)),
            gemm(f"DSpark d(rows) = dz E ({n} passes, fp32 out)", R, H, Vd, c_bytes=4,
                 call=call(H, Vd)),
            gemm(f"DSpark d(e) = dz W2 ({n} passes, fp32 out)", R, r, Vd, c_bytes=4,
                 call=call(r, Vd)),
            gemm(f"DSpark dW2 += dz^T e ({n} passes, fp32 +=)", Vd, r, R, c_bytes=4, beta=1.0,
                 call=(Vd, r, min(DSPARK_ROWS, R))),
            mem(f"DSpark confidence paths into d(rows), d(e) ({n} passes)", "dspark_conf_rows",
                R * H * (4 + 2 + 2) + 8 * R * r, launches=n),
            mem(f"DSpark dW1 rows, d(confidence head) in row order ({n} passes)",
                "dspark_param_grads", 4 * 2 * R * r + 2 * R * (H + r) + 8 * R, launches=n),
            mem("sequence loss sum(w*loss), kept on the device", "seq_loss", 12 * R)]
    for o in ops:
        if o.name.startswith("DSpark") and o.kind == "gemm":
            o.launches = n
    return ops


def dspark_kernels():
    """The kernels of DSpark's objective (cuda/kernels.cu dspark_*), priced by
    dspark_sequence_tail when the config is DSpark; listed so the coverage test knows them
    with a DFlash config."""
    return {
        "dspark_loss_rows": "per pass of 64 rows: read the draft [n,V_d] and target [n,V] "
                            "logits fp32, write probabilities, signs and d(z) bf16",
        "dspark_conf_rows": "per pass: d(rows) [n,H] from the fp32 accumulator, d(e) [n,r]",
        "dspark_param_grads": "per pass: W1's rows [n,r] and the confidence head [H+r+1]",
    }


def muon_matrices(c):
    """[rows, cols] of the tensors Muon takes (src/train/optim_muon.c df_muon_takes: 2-D,
    both sides > 1, no codebook): fc, per layer q, k, v, o, gate, up, down; DFlash 2's kernel
    projections [2kG, H] and hidden_projection [r, H] (its base kernels are 3-D)."""
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qd, kd = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [(H, H * len(c["target_layer_ids"]))]
    layer = [(qd, H), (kd, H), (kd, H), (H, qd), (I, H), (I, H), (H, I)]
    out += layer * c["num_hidden_layers"]
    x = c.get("dflash2")
    if x:
        out += [(2 * x["k"] * (H // x["g"]), H)] * (2 * c["num_hidden_layers"])
        out.append((x["r"], H))
    return out


def newton_schulz_flops(rows, cols):
    """Muon's 5 quintic steps on an r x c matrix, r <= c the smaller side: the Gram matrix
    (2 r^2 c), its polynomial (2 r^3) and the product with the matrix (2 r^2 c)."""
    r, c = min(rows, cols), max(rows, cols)
    return 5 * (4.0 * r * r * c + 2.0 * r ** 3)


def tf32_peak(gpu):
    """The dense TF32 tensor-core peak: the datasheet's where recorded (H200), else assumed
    half the bf16 peak (Hopper's and datacenter Blackwell's ratio)."""
    return gpu.get("tf32", gpu["peak"] / 2)


def muon_owners(mats, world):
    """cuda/arena.cu assign_muon_owners: by decreasing Newton-Schulz FLOPs (ties in order),
    each matrix to the least loaded rank (ties to the lowest). Returns (owners, loads)."""
    load, owner = [0.0] * world, [0] * len(mats)
    cost = [4.0 * min(r, k) ** 2 * max(r, k) + 2.0 * min(r, k) ** 3 for r, k in mats]
    for i in sorted(range(len(mats)), key=lambda i: -cost[i]):
        o = load.index(min(load))
        owner[i] = o
        load[o] += cost[i]
    return owner, load


def muon_ops(c, n, world):
    """cuda/backend.cu muon_step's rows (MUON), for the busiest rank: on this rank's shard the
    momentum (Muon's elements) beside AdamW (the rest); the fp32 updates all-gathered per
    bucket through the staging buffer; per matrix this rank owns (muon_owners): its pieces
    copied out of the staging buffer, the Frobenius norm, 5 Newton-Schulz steps of three TF32
    cuBLAS products and two copies; per matrix, its owner's result broadcast, then the step on
    this rank's slices."""
    mats = muon_matrices(c)
    owner, load = muon_owners(mats, world)
    busiest = load.index(max(load))
    nm = sum(r * k for r, k in mats)
    npad = -(-n // world) * world
    shard, mshard = npad // world, -(-nm // world)
    nb = len(buckets(n, world))
    f = (world - 1) / world
    ops = [mem("Muon momentum (fp32 buffer, update out)", "muon_momentum", 16 * mshard,
               launches=nb, flops=6.0 * mshard),
           mem("AdamW on the rest (fp32 master, moments; bf16 copy)", "adamw",
               30 * (shard - mshard), launches=nb, flops=14.0 * (shard - mshard)),
           Op("Muon update all-gather (fp32)", "ncclAllGather", "comm", 0,
              f * 4 * nm if world > 1 else 0, launches=nb if world > 1 else 0),
           # a broadcast's bus bandwidth is its algorithm bandwidth (NCCL's performance notes)
           Op("Muon results broadcast from their owners (fp32)", "ncclBroadcast", "comm", 0,
              4 * nm if world > 1 else 0, launches=len(mats) if world > 1 else 0)]
    for i, (r, k) in enumerate(mats):
        a, b = min(r, k), max(r, k)
        tag = f"Muon matrix {i} [{r}, {k}]"
        if owner[i] != busiest:
            ops.append(mem(f"{tag}: step on this rank's slices (master, bf16 copy)",
                           "muon_apply", 14 * r * k / world))
            continue
        ops += [mem(f"{tag}: pieces out of the staging buffer", "cudaMemcpyAsync", 8 * r * k),
                mem(f"{tag}: Frobenius norm", "sumsq_partial+sumsq_final", 4 * r * k,
                    launches=2),
                mem(f"{tag}: normalise", "muon_normalize", 8 * r * k),
                sgemm(f"{tag}: Newton-Schulz Gram matrices (5)", a, a, b, 5),
                sgemm(f"{tag}: Newton-Schulz polynomials (5)", a, a, a, 5, beta=True),
                sgemm(f"{tag}: Newton-Schulz products (5)", a, b, a, 5, beta=True),
                mem(f"{tag}: Newton-Schulz copies (5 x 2)", "cudaMemcpyAsync",
                    5 * 8 * (a * a + r * k), launches=10),
                mem(f"{tag}: step on this rank's slices (master, bf16 copy)", "muon_apply",
                    14 * r * k / world)]
    return ops


def sgemm(name, M, N, K, count, beta=False):
    """cublasGemmEx C[M,N] (+)= A[M,K] B[K,N], fp32 operands with CUBLAS_COMPUTE_32F_FAST_TF32
    (Muon's Newton-Schulz): not model FLOPs, at the GPU's TF32 tensor peak."""
    fl = count * 2.0 * M * N * K
    by = count * (4 * (M * K + K * N) + 4 * M * N * (2 if beta else 1))
    return Op(name, "cublasGemmEx", "gemm", fl, by, 0.0, count, 1,
              dict(M=M, N=N, K=K, c_bytes=4, beta=1.0 if beta else 0.0, call=(M, N, K),
                   tf32=True))


def step_ops(c, n, world):
    """df_cu_zero_grad + df_cu_step: norms, AdamW on this rank's shard, ZeRO-1 collectives.
    The norm and clip factor are computed on the device (norm_sum, the all-reduce, norm_clip)
    and AdamW and the clip scaling read them there; 32 bytes go to pinned host memory for
    dflash_trainer_step_result, which waits for the step (not for what follows it)."""
    npad = -(-n // world) * world
    shard = npad // world
    per = max(world, BUCKET_ELEMS // world * world)
    nb = -(-npad // per)
    f = (world - 1) / world
    ops = [Op("deferred losses and NaN/Inf checks (D2H, once per step)", "cudaMemcpyAsync",
              "d2h", 0, 16),
           mem("zero gradients", "cudaMemsetAsync", 4 * npad),
           Op(f"gradient reduce-scatter ({'bf16' if RS_BYTES == 2 else 'fp32'})",
              "ncclReduceScatter", "comm", 0,
              f * RS_BYTES * npad if world > 1 else 0, launches=nb if world > 1 else 0),
           mem("gradient sum of squares", "sumsq_partial+sumsq_final", 4 * shard, launches=2 * nb),
           mem("norm: bucket sums, then sqrt and clip factor (1 thread each)", "norm_sum+norm_clip",
               8 * nb + 64, launches=2),
           Op("gradient norm all-reduce (1 double, on the device)", "ncclAllReduce", "comm", 0,
              8 if world > 1 else 0, launches=1 if world > 1 else 0),
           Op("norm and clip factor to pinned host memory (D2H, read by step_result)",
              "cudaMemcpyAsync", "d2h", 0, 32),
           ] + (muon_ops(c, n, world) if MUON else [
           mem("AdamW (fp32 master, moments; bf16 copy)", "adamw", 30 * shard, launches=nb,
               flops=14.0 * shard)])
    if RS_BYTES == 2 and world > 1:  # bf16 reduce-scatter: round every bucket, widen the slice
        ops.append(mem("gradients to bf16 for the reduce-scatter", "f32_to_bf16", 6 * npad,
                       launches=nb))
        ops.append(mem("reduced slice back to fp32", "bf16_to_f32", 6 * shard, launches=nb))
    # launched every step; it returns at once unless the factor is below 1
    ops.append(mem("clip: scale gradients", "scale_clipped", 8 * shard if ADAM_CLIP_ACTIVE else 0,
                   launches=nb))
    ops.append(Op("weight all-gather (bf16)", "ncclAllGather", "comm", 0,
                  f * 2 * npad if world > 1 else 0, launches=nb if world > 1 else 0))
    return ops


# Kernels launched outside a training step (the coverage test needs a row for each).
NOT_IN_STEP = {
    "rope_table": "once per new longest position (ensure_rope), then cached",
    "f32_to_bf16": "uploads at create and load (embedding, LM head, weights); in the step only "
                   "with the bf16 reduce-scatter (--rs-bf16)",
    "bf16_to_f32": "only with the bf16 reduce-scatter (--rs-bf16)",
    "lmhead_argmax_init": "predict (evaluation) only",
    "lmhead_argmax_chunk": "predict (evaluation) only",
    "scale": "df_cu_scale_grads (sequences of different grad_scale), and with several ranks the "
             "factor 1 / (grad_scale x global weight) when it is not 1 (dflash_train_run's "
             "grad_scale 1/W makes it 1 up to rounding)",
}


def dflash2_kernels():
    """The kernels of cuda/dflash2.cu (DFlash 2's convolutions and candidate selector), each
    priced by a row when the config is DFlash 2 (df2_conv_forward, df2_layer_backward,
    df2_selector_ops; --dflash2); listed here too so the coverage test knows them with a
    DFlash 1 config, and df2_select_greedy_block (predict only) has no step row:"""
    return {
        "df2_conv_apply": "per conv and sublayer: read x [T,H] and k taps, write [T,H]",
        "df2_conv_backward_dx": "per conv: read dout [T,H], write dx [T,H]",
        "df2_conv_backward_ddyn": "per conv: read dout and x [T,H], write [T,k,H/g]",
        "df2_conv_backward_dbase_partial": "per conv: read dout and x [T,H], k partial rows per segment",
        "df2_conv_backward_dbase_reduce": "per conv: sum <= 64 partials of [k,H]",
        "df2_lmhead_topk_init": "per sequence: [R,K]",
        "df2_lmhead_topk_chunk": "per vocabulary chunk: read logits [R,chunk] (beside lmhead_ce_chunk)",
        "df2_selector_target_logit": "per sequence: R dot products of H",
        "df2_selector_row": "per sequence: R x K x (r + H) multiply-adds",
        "df2_selector_scatter_chunk": "per vocabulary chunk, twice: R x K writes",
        "df2_add_rows": "per sequence: [R,H]",
        "df2_select_greedy_block": "predict only: A x (B-1) x K x r",
    }


# Muon's kernels (--optimizer muon prices them in muon_ops), listed so that the coverage
# test knows them with the default AdamW step.
MUON_KERNELS = {
    "muon_momentum": "per bucket: this rank's slice of the Muon matrices, 16 B per element",
    "muon_normalize": "per Muon matrix: the Frobenius normalisation, 8 B per element",
    "muon_apply": "per Muon matrix and bucket slice: the step on this rank's masters",
    "ncclBroadcast": "per Muon matrix: its owner's orthogonalised update to every rank",
}


def model_kernels(r):
    """Kernel and call names the model has a row for (the coverage test's list)."""
    names = set(NOT_IN_STEP) | set(dflash2_kernels()) | set(dspark_kernels()) | set(MUON_KERNELS)
    for o, _ in r["rows"]:
        names.update(o.kernel.split("+"))
    return names


def gemm_time(o, gpu):
    M, N, K = o.extra["M"], o.extra["N"], o.extra["K"]
    peak = tf32_peak(gpu) if o.extra.get("tf32") else gpu["peak"]  # Muon's Newton-Schulz
    tiles = -(-M // GEMM_TILE[0]) * -(-N // GEMM_TILE[1])
    waves = -(-tiles // gpu["sms"])
    wave_eff = tiles / (waves * gpu["sms"])
    eff = GEMM_EFF * wave_eff * K / (K + 128)
    o.extra["eff"] = eff
    return max(o.flops / (peak * eff), o.bytes / (gpu["bw"] * MEM_EFF))


def op_time(o, gpu, world):
    t = o.launches * LAUNCH_S
    if o.kind == "gemm":
        t += gemm_time(o, gpu)
    elif o.kind == "attn":
        hbm = o.bytes / (gpu["bw"] * MEM_EFF)
        l2 = o.extra.get("l2", 0) / gpu["l2bw"]
        if o.extra.get("mma"):
            t += mma_kernel_time(o, gpu)
        elif "time" in o.extra:
            t += max(o.extra["time"], hbm)
        else:
            t += max(o.flops / (gpu["peak"] * o.extra["eff"]), hbm, l2)
    elif o.kind == "comm":
        t = o.launches * NCCL_LAT_S + o.bytes / gpu["busbw"] if world > 1 else 0.0
    elif o.kind in ("h2d", "d2h"):
        t += o.bytes / PCIE_BW
    elif o.kind == "host":
        t = o.bytes / o.extra["rate"]
    else:
        t += o.bytes / (gpu["bw"] * MEM_EFF)
    return t


def arena_bytes(c, seq_len, anchors, chunk):
    """src/train/plan.c df_act_layout_compute at --plan's dims (Sc = seq_len)."""
    H, I, d, L = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    nh, nkv, B = c["num_attention_heads"], c["num_key_value_heads"], c["block_size"]
    KH, qd, kd = H * len(c["target_layer_ids"]), nh * d, nkv * d
    T, Sc, R, A = anchors * B, seq_len, anchors * (B - (0 if c.get("dspark") else 1)), anchors
    ch = min(chunk, c["vocab_size"])
    g = [2 * Sc * KH, 2 * Sc * H, 4 * Sc, 2 * Sc * H, 2 * T * H, 4 * T, 2 * T * H, 2 * T * H,
         4 * T * H, 2 * T * qd, 2 * T * kd, 2 * T * kd, 2 * T * qd, 2 * T * I, 2 * T * I,
         2 * T * I, 2 * T * max(qd, kd), 4 * T * nh, 2 * Sc * kd, 2 * Sc * kd, 4 * Sc * H,
         2 * Sc * max(kd, H), 2 * R * H, 2 * R * H, 4 * R * H, 4 * R * ch, 2 * R * ch,
         4 * 5 * R, 4 * 2 * R, 4 * 2 * T, 4 * A]
    lay = [2 * T * H, 4 * T, 2 * T * H, 2 * T * qd, 4 * T * nh, 2 * T * qd, 2 * T * kd,
           4 * T * nkv, 2 * T * kd, 2 * T * kd, 2 * Sc * kd, 4 * Sc * nkv, 2 * Sc * kd,
           2 * Sc * kd, 2 * T * qd, 4 * T * nh, 2 * T * H, 4 * T, 2 * T * H, 2 * T * I,
           2 * T * I, 2 * T * I]
    up = lambda x: (x + 255) // 256 * 256
    return sum(up(x) for x in g) + L * sum(up(x) for x in lay)


def memory(c, n, world, seq_len, anchors, chunk):
    """Steady-state device bytes per GPU (model.cu's allocations, ZeRO-1 shards)."""
    npad = -(-n // world) * world
    shard = npad // world
    vh = c["vocab_size"] * c["hidden_size"]
    half, wide = c["head_dim"] // 2, max(c["hidden_size"], c["head_dim"])
    parts = dict(weights=2 * npad, grads=4 * npad, masters=4 * shard, moments=8 * shard,
                 frozen=2 * 2 * vh, activations=arena_bytes(c, seq_len, anchors, chunk),
                 # src/train/cuda/dfcuda.h df_cu_fixed_scratch_bytes: staging, RoPE frequencies, norm
                 # scratch, sum-of-squares partials, cos/sin tables and positions, the
                 # per-sequence results (1024 deferred) and position weights, and the two
                 # stages of context rows as stored (bounded at fp32's 4 bytes a value)
                 staging=4 * BUCKET_ELEMS,
                 scratch=8 * half + 4 * 256 * wide + 8 * (1024 + 4096) + 32 +
                 (seq_len + c["block_size"]) * (2 * half * 4 + 4) + 8 * (2 * 1024 + 1) +
                 4 * c["block_size"] +
                 2 * (4 * (seq_len + c["block_size"]) * len(c["target_layer_ids"]) *
                      c["hidden_size"] + 256))
    x = c.get("dflash2")
    if x:  # cuda/dflash2.cu layout(): its own buffers beside the arena (T block rows, R rows)
        T, R, H = anchors * c["block_size"], anchors * (c["block_size"] - 1), c["hidden_size"]
        kg2, L = 2 * x["k"] * (H // x["g"]), c["num_hidden_layers"]
        up = lambda v: (v + 255) // 256 * 256
        parts["dflash2"] = (L * 2 * (up(4 * T * kg2) + 2 * up(2 * T * H)) + up(2 * T * H) +
                            up(4 * T * H) + up(4 * T * kg2) + up(2 * T * kg2) +
                            up(4 * 64 * x["k"] * H) + 3 * up(4 * R * x["K"]) + 3 * up(4 * R) +
                            up(4 * R * x["r"]) + 3 * up(2 * R * x["r"]) + up(4 * R * H))
    x = c.get("dspark")
    if x:  # src/train/cuda/dfcuda.h df_cu_dspark_bytes: per row its previous token, final
        # state, Markov embedding and confidence gradient; per pass the fp32 draft (V_d) and
        # target (V) logits, the draft's bf16 gradient and the embeddings' gradient; pruned,
        # the drafter's head (the kept rows, bf16) and the kept ids
        R, H, V = anchors * c["block_size"], c["hidden_size"], c["vocab_size"]
        Vd = draft_vocab(c)
        parts["dspark"] = (R * (4 + 2 * H + 2 * x["r"] + 4) +
                           DSPARK_ROWS * (Vd * 6 + V * 4 + 4 * x["r"]) +
                           (Vd * (2 * H + 4) if Vd < V else 0))
    if MUON:  # src/train/cuda/dfcuda.h df_cu_muon_scratch_bytes: the largest matrix twice, its
        # Gram matrix twice (fp32), one double
        mats = muon_matrices(c)
        parts["muon"] = 4 * (2 * max(r * k for r, k in mats) +
                             2 * max(min(r, k) ** 2 for r, k in mats)) + 8
    parts["total"] = sum(parts.values())
    return parts


def tensor_starts(c):
    """Flat offsets (model.c's table order) where the backward's completion points begin:
    the final norm, then each layer (last first), then 0 (hidden norm and fc)."""
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qd, kd = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = 2 * H + 2 * qd * H + 2 * kd * H + 2 * d + 3 * I * H
    first = H * len(c["target_layer_ids"]) * H + H
    L = c["num_hidden_layers"]
    return first + L * layer, [first + l * layer for l in range(L)]


def buckets(n, world):
    """src/train/cuda/dist.c df_bucket_layout_init: (offset, count), numbered from the end."""
    npad = -(-n // world) * world
    per = max(world, BUCKET_ELEMS // world * world)
    out, end = [], npad
    while end > 0:
        k = min(end, per)
        out.append((end - k, k))
        end -= k
    return out


def exposed_reduce_scatter(c, seq, n, gpu, world):
    """cuda/model.cu with several ranks: the last sequence's backward issues each gradient
    bucket's reduce-scatter on a communication stream once the backward has finished every
    tensor in it (issue_ready after the final norm, after each layer, after fc); the
    collectives run one after another there. Returns the reduce-scatter time left after
    the backward's end (compute assumed not slowed by the concurrent NCCL kernels)."""
    if world <= 1:
        return 0.0
    if c.get("dflash2"):  # model.cu: DFlash 2's gradients are final only after the backward
        return sum(NCCL_LAT_S + (world - 1) / world * RS_BYTES * k / gpu["busbw"]
                   for _, k in buckets(n, world))
    norm_off, layer_off = tensor_starts(c)
    t, marks = 0.0, []  # (time, lowest flat offset whose gradients are final by then)
    L = c["num_hidden_layers"]
    for o in seq:
        if not o.extra.get("bwd") or o.kind in ("comm", "d2h"):
            continue
        t += op_time(o, gpu, world)
        if o.name == "final norm dw":
            marks.append((t, norm_off))
        m = re.match(r"L(\d+) bwd input norm dx", o.name)
        if m:
            marks.append((t, layer_off[int(m.group(1))]))
        if o.name == "fc dw":
            marks.append((t, 0))
    assert len(marks) == L + 2, marks
    end, free, f = t, 0.0, (world - 1) / world
    for off, count in buckets(n, world):
        ready = next(tm for tm, done in marks if done <= off)
        free = max(free, ready) + NCCL_LAT_S + f * RS_BYTES * count / gpu["busbw"]
    return max(0.0, free - end)


def model(c, gpu_name="H200", seq_len=3072, n_anchors=512, batch=1, world=1, chunk=16384,
          design="mma"):
    """Per-op rows and totals of one step on one of `world` GPUs, in four schedules:
    `before` (the backend before item 4: fp32 rows checked and converted on the host,
    then uploaded, then computed, one after another), `sync` (the rows copied as stored
    into a pinned stage and uploaded on a copy stream while the previous sequence
    computes, converted and checked on the device, no wait per sequence; but the step
    waits for its norm, so the first sequence of the next step has nothing to hide behind:
    the backend before dflash_trainer_step_async, and DFLASH_TRAIN_SYNC_STEP=1 now), `now`
    (as the backend runs: the last sequence's backward is deferred to the step, whose norm,
    clip factor, AdamW and all-gather are enqueued without a host wait; the next step's
    first sequence is copied into the free pinned stage and uploaded while they run, so
    only what of its host copy + upload outlasts that backward + optimizer is exposed) and
    `overlap` (all host work and uploads hidden, the first sequence's too). In each, the
    gradient reduce-scatter is overlapped with the last sequence's backward, bucket by
    bucket (item 5), only its tail exposed; the all-gather follows the optimizer. Host
    latency between collect and the step's launches (microseconds) is not modelled."""
    gpu = GPUS[gpu_name]
    s = Seq(c, seq_len, n_anchors)
    seq = sequence_ops(c, s, gpu, design, chunk)
    for o in seq:
        o.count = batch
    n = param_count(c)
    ops = seq + step_ops(c, n, world)
    rows = [(o, op_time(o, gpu, world) * o.count) for o in ops]
    by = lambda pred: sum(t for o, t in rows if pred(o))
    dev = by(lambda o: o.kind in ("gemm", "mem", "attn", "d2h"))
    host, h2d = by(lambda o: o.kind == "host"), by(lambda o: o.kind == "h2d")
    rs = by(lambda o: o.kernel == "ncclReduceScatter")
    ag = by(lambda o: o.kernel == "ncclAllGather")
    bwd = by(lambda o: o.extra.get("bwd") and o.kind != "comm")
    rs_exposed = exposed_reduce_scatter(c, seq, n, gpu, world)
    # One sequence's host copy and upload: the others of a step run while the device computes
    # the sequence before them; the first runs behind the step before it (`now`: the last
    # backward, the optimizer and the collectives after the collect), or behind nothing
    # (`sync`: the step waited for its norm).
    first = (host + h2d) / batch
    hidden = max(0.0, (host + h2d) - first - dev)
    step_names = {o.name for o in step_ops(c, n, world)}
    opt_dev = by(lambda o: o.name in step_names and o.kind in ("gemm", "mem", "attn", "d2h"))
    behind = bwd / batch + opt_dev + rs_exposed + ag  # after collect, until the next forward
    first_now = max(0.0, first - behind)
    first_1 = max(0.0, first - (bwd / batch + opt_dev))  # one GPU: no collectives
    KH = c["hidden_size"] * len(c["target_layer_ids"])
    dec = by(lambda o: o.kernel == "hidden_decode")
    # before item 4: fp32 rows checked (one thread) and converted (pool) on the host, bf16
    # uploaded into the arena; no decode on the device.
    host_before = batch * (4 * s.len * KH / HOST_CHECK_BW + 6 * s.Sc * KH / HOST_CONV_BW)
    before = (dev - dec) + host_before + h2d + rs_exposed + ag
    sync = first + dev + hidden + rs_exposed + ag
    now = first_now + dev + hidden + rs_exposed + ag
    overlap = max(dev, host + h2d) + rs_exposed + ag
    single = first_1 + dev + hidden  # one GPU: no collectives
    model_flops = sum(o.model_flops * o.count for o in ops)
    mem_ = memory(c, n, world, seq_len, n_anchors, chunk)
    sched = {}
    for name, step, compute in (("before", before, (dev - dec) + host_before + h2d),
                                ("sync", sync, first + dev + hidden),
                                ("now", now, first_now + dev + hidden),
                                ("overlap", overlap, max(dev, host + h2d))):
        sched[name] = dict(step_s=step, compute_s=compute, comm_s=step - compute,
                           tokens_per_s=batch * s.T / step * world,
                           seq_tokens_per_s=batch * seq_len / step * world,
                           mfu=model_flops / (step * gpu["peak"]), scaling=compute / step)
    return dict(config=c["name"], gpu=gpu_name, source=gpu["source"], seq_len=seq_len,
                anchors=s.A, batch=batch, world=world, vocab_chunk=chunk, attention=design,
                params=n, T=s.T, Sc=s.Sc, R=s.R, rows=rows, model_flops=model_flops,
                exec_flops=sum(o.flops * o.count for o in ops), device_s=dev, host_s=host,
                host_before_s=host_before, h2d_s=h2d, exposed_upload_s=first_now + hidden,
                first_upload_s=first, first_behind_s=behind,
                reduce_scatter_s=rs, reduce_scatter_exposed_s=rs_exposed, all_gather_s=ag,
                backward_s=bwd, single_gpu_mfu=model_flops / (single * gpu["peak"]),
                sched=sched, step_s=now, memory=mem_, fits=mem_["total"] <= gpu["mem"])


def groups(rows):
    """Per-op rows merged across layers (L0..Ln of one op share one row)."""
    out = {}
    for o, t in rows:
        key = o.name.split(" ", 1)[1] if o.name[:1] == "L" and o.name[1:2].isdigit() else o.name
        g = out.setdefault(key, dict(name=key, kernel=o.kernel, kind=o.kind, n=0, flops=0.0,
                                     bytes=0.0, model_flops=0.0, s=0.0))
        g["n"] += o.count
        g["flops"] += o.flops * o.count
        g["bytes"] += o.bytes * o.count
        g["model_flops"] += o.model_flops * o.count
        g["s"] += t
    return list(out.values())


def category(o):
    """A coarse class of an op, for the summary table."""
    if o.kind in ("host", "h2d", "d2h", "comm", "attn"):
        return {"host": "host: rows into the pinned stage", "h2d": "uploads (H2D)",
                "d2h": "uploads (H2D)", "comm": "NCCL collectives (ZeRO-1)",
                "attn": "attention " + ("forward" if o.kernel == "attention_forward" else "backward")}[o.kind]
    if o.kind == "gemm" and not o.extra.get("fp32"):
        if o.name.startswith("LM head"):
            return "LM head GEMMs (chunked)"
        if o.name.startswith("fc"):
            return "fc GEMMs (fwd, dW)"
        return "layer GEMMs " + ("backward" if o.extra.get("bwd") else "forward")
    if o.kernel.startswith("lmhead_ce_"):
        return "CE kernels"
    if o.kernel in ("adamw", "scale_clipped", "sumsq_partial+sumsq_final", "norm_sum+norm_clip") \
            or o.name == "zero gradients" or o.name.startswith("Muon"):
        return "optimizer (zero, norm, AdamW, clip)"
    return "norms, RoPE, SwiGLU, gathers, copies"


def print_categories(r, out=sys.stdout):
    """Per class of op: FLOPs, bytes, predicted ms (the serial schedule)."""
    cats = {}
    for o, t in r["rows"]:
        c = cats.setdefault(category(o), [0.0, 0.0, 0.0, 0.0])
        c[0] += o.flops * o.count
        c[1] += o.bytes * o.count
        c[2] += t
        c[3] += o.model_flops * o.count
    peak = GPUS[r["gpu"]]["peak"]
    print(f"| {r['config']} on {r['gpu']} | TFLOP | GB | ms | MFU % of the op |", file=out)
    print("|---|---:|---:|---:|---:|", file=out)
    for k, (fl, by, t, mf) in cats.items():
        print(f"| {k} | {fl / 1e12:.2f} | {by / 1e9:.2f} | {t * 1e3:.1f} | "
              f"{100 * mf / (t * peak) if mf else 0:.1f} |", file=out)


def print_markdown(r, out=sys.stdout):
    """The per-op table as Markdown (for an issue note)."""
    p = lambda *a: print(*a, file=out)
    peak = GPUS[r["gpu"]]["peak"]
    p(f"| op ({r['config']}, {r['gpu']}, summed over layers) | kernel | GFLOP | GB | ms | % of step | MFU % |")
    p("|---|---|---:|---:|---:|---:|---:|")
    for g in groups(r["rows"]):
        eff = f"{100 * g['model_flops'] / (g['s'] * peak):.1f}" if g["model_flops"] else ""
        p(f"| {g['name']} | {g['kernel']} | {g['flops'] / 1e9:.1f} | {g['bytes'] / 1e9:.3f} | "
          f"{g['s'] * 1e3:.3f} | {100 * g['s'] / r['step_s']:.1f} | {eff} |")


def print_table(r, ops=True, out=sys.stdout):
    p = lambda *a: print(*a, file=out)
    p(f"== {r['config']} on {r['gpu']} ({r['source']}): seq {r['seq_len']}, {r['anchors']} "
      f"anchors (T {r['T']} block tokens, Sc {r['Sc']}, R {r['R']} supervised rows), batch "
      f"{r['batch']}, world {r['world']}, vocab chunk {r['vocab_chunk']}, attention {r['attention']}")
    if ops:
        peak = GPUS[r["gpu"]]["peak"]
        p(f"{'op (summed over layers)':52s} {'kernel':27s} {'n':>3s} {'GFLOP':>9s} {'GB':>7s} "
          f"{'ms':>8s} {'%step':>5s} {'MFU%':>5s}")
        for g in groups(r["rows"]):
            eff = f"{100 * g['model_flops'] / (g['s'] * peak):5.1f}" if g["model_flops"] else "    -"
            p(f"{g['name'][:52]:52s} {g['kernel'][:27]:27s} {g['n']:3d} {g['flops'] / 1e9:9.1f} "
              f"{g['bytes'] / 1e9:7.3f} {g['s'] * 1e3:8.3f} {100 * g['s'] / r['step_s']:5.1f} {eff}")
    m = r["memory"]
    peak = GPUS[r["gpu"]]["peak"]
    lost = sorted(((g["s"] - g["model_flops"] / peak, g["name"]) for g in groups(r["rows"])),
                  reverse=True)[:6]
    p("-- time lost against the peak (op time - its model FLOPs at peak), largest: " +
      ", ".join(f"{n} {t * 1e3:.1f} ms" for t, n in lost))
    p(f"-- per step: device {r['device_s'] * 1e3:.1f} ms, host copy into the pinned stage "
      f"{r['host_s'] * 1e3:.1f} (before item 4: check + conversion "
      f"{r['host_before_s'] * 1e3:.1f}), "
      f"upload {r['h2d_s'] * 1e3:.1f} (host + upload exposed {r['exposed_upload_s'] * 1e3:.1f}), "
      f"reduce-scatter {r['reduce_scatter_s'] * 1e3:.1f} "
      f"({r['reduce_scatter_exposed_s'] * 1e3:.1f} past the backward), "
      f"all-gather {r['all_gather_s'] * 1e3:.1f} (backward {r['backward_s'] * 1e3:.1f})")
    p(f"-- model {r['model_flops'] / 1e12:.2f} TFLOP per GPU-step (executed "
      f"{r['exec_flops'] / 1e12:.2f}); 1 GPU, serial: MFU {100 * r['single_gpu_mfu']:.1f} %")
    p(f"-- next step's first sequence: host copy + upload {r['first_upload_s'] * 1e3:.1f} ms "
      f"behind the step's last backward + optimizer + collectives "
      f"{r['first_behind_s'] * 1e3:.1f} ms")
    for name, what in (("before", "before item 4 (host check + conversion serial)"),
                       ("sync", "the step waiting for its norm (DFLASH_TRAIN_SYNC_STEP=1: the "
                                "next step's first upload exposed)"),
                       ("now", "as the backend runs (dflash_trainer_step_async: the first "
                               "upload behind the step before)"),
                       ("overlap", "with every upload hidden (the first sequence's too)")):
        x = r["sched"][name]
        p(f"-- {what}: step {x['step_s'] * 1e3:.1f} ms, {x['tokens_per_s']:.0f} block tokens/s "
          f"({x['seq_tokens_per_s']:.0f} sequence tokens/s) on {r['world']} GPU(s), MFU "
          f"{100 * x['mfu']:.1f} %, {r['world']}-GPU scaling {100 * x['scaling']:.1f} %")
    p(f"-- memory per GPU {m['total'] / 2**30:.2f} GiB ({'fits' if r['fits'] else 'DOES NOT FIT'} "
      f"{GPUS[r['gpu']]['mem'] / 2**30:.0f} GiB): weights {m['weights'] / 2**30:.2f}, grads "
      f"{m['grads'] / 2**30:.2f}, masters {m['masters'] / 2**30:.2f}, moments "
      f"{m['moments'] / 2**30:.2f}, frozen {m['frozen'] / 2**30:.2f}, activations "
      f"{m['activations'] / 2**30:.2f}, staging + scratch "
      f"{(m['staging'] + m['scratch']) / 2**30:.2f}"
      + (f", DFlash 2's buffers {m['dflash2'] / 2**30:.2f}" if "dflash2" in m else "")
      + (f", Muon workspace {m['muon'] / 2**30:.2f}" if "muon" in m else "") +
      f" (the CUDA context and allocator slack not "
      f"counted)")


def gemm_calls(r):
    """One line per distinct GEMM of the step (layer 0 standing for every layer): a name,
    the shape of one cuBLAS call, C's element size, beta, calls per step, and the
    predicted ms of one call."""
    gpu, seen, out = GPUS[r["gpu"]], set(), []
    for o, _ in r["rows"]:
        if o.kind != "gemm" or o.extra.get("fp32"):  # gpu_bench gemm runs bf16 GemmEx only
            continue
        name = o.name.split(" ", 1)[1] if o.name[:1] == "L" and o.name[1:2].isdigit() else o.name
        key = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
        if key in seen:
            continue
        seen.add(key)
        M, N, K = o.extra["call"]
        x = dict(M=M, N=N, K=K)
        one = Op(key, "cublasGemmEx", "gemm", 2.0 * M * N * K,
                 2 * (M * K + K * N) + o.extra["c_bytes"] * M * N * (2 if o.extra["beta"] else 1),
                 extra=x)
        calls = o.launches * o.count * sum(1 for p, _ in r["rows"] if p.name.endswith(" " + name)
                                           or p.name == name)
        out.append(dict(name=key, M=M, N=N, K=K, c_bytes=o.extra["c_bytes"], beta=o.extra["beta"],
                        calls=calls, ms=op_time(one, gpu, 1) * 1e3))
    return out


def compare(r, path, out=sys.stdout):
    """Measured (gpu_bench "json" lines) next to predicted: the step, and each GEMM."""
    p = lambda *a: print(*a, file=out)
    steps, gemms = [], {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("json "):
                continue
            j = json.loads(line[5:])
            if "gemm" in j:
                gemms[(j["gemm"], j["M"], j["N"], j["K"])] = j
            elif (j.get("shape") == r["config"] and j.get("seq_len") == r["seq_len"]
                  and j.get("anchors") == r["anchors"]):
                steps.append(j)
    x, peak = r["sched"]["now"], GPUS[r["gpu"]]["peak"]
    p(f"== measured vs predicted: {r['config']} seq {r['seq_len']} anchors {r['anchors']} on "
      f"{r['gpu']} (1 GPU, the backend's serial schedule)")
    for j in steps:
        p(f"   step       predicted {x['step_s'] * 1e3:9.2f} ms   measured {j['step_s'] * 1e3:9.2f} ms"
          f"   (x{j['step_s'] / x['step_s']:.2f})")
        p(f"   tokens/s   predicted {x['tokens_per_s']:9.0f}      measured {j['block_tokens_per_s']:9.0f}")
        p(f"   MFU        predicted {100 * x['mfu']:8.1f} %      measured {100 * r['model_flops'] / (j['step_s'] * peak):8.1f} %"
          f" of the datasheet peak ({100 * j['mfu_vs_cublas']:.1f} % of cuBLAS's measured "
          f"{j['cublas_tflops']:.0f} TFLOP/s); model TFLOP {r['model_flops'] / 1e12:.3f}, "
          f"gpu_bench's count {j['model_tflop']:.3f}")
        p(f"   memory     predicted {r['memory']['total'] / 2**30:8.2f} GiB    in use "
          f"{j['device_in_use_gib']:8.2f} GiB (whole device, with the CUDA context)")
    if not steps:
        p("   (no step measurement for this shape)")
    tp = tm = 0.0
    key = lambda g: (g["name"], g["M"], g["N"], g["K"])
    rows = [g for g in gemm_calls(r) if key(g) in gemms]
    if rows:
        p(f"   {'GEMM (one call)':44s} {'M':>6s} {'N':>6s} {'K':>6s} {'calls':>5s} "
          f"{'pred ms':>8s} {'meas ms':>8s} {'ratio':>6s}")
    for g in rows:
        m = gemms[key(g)]["ms"]
        tp, tm = tp + g["calls"] * g["ms"], tm + g["calls"] * m
        p(f"   {g['name'][:44]:44s} {g['M']:6d} {g['N']:6d} {g['K']:6d} {g['calls']:5d} "
          f"{g['ms']:8.3f} {m:8.3f} {m / g['ms'] if g['ms'] else 0:6.2f}")
    if rows:
        p(f"   GEMMs of one step: predicted {tp:.2f} ms, measured {tm:.2f} ms")


def kernel_of(name, known):
    """The model's kernel for one profiled kernel name (nsys's demangled name): a model
    kernel named in it as a function (`attention_forward(`, `rmsnorm_backward<`), cuBLAS's own kernels
    (gemm, xmma, cutlass, nvjet) as cublasGemmEx, NCCL's as its collectives."""
    for k in sorted(known, key=len, reverse=True):
        if re.search(r"(^|[^A-Za-z0-9_])" + re.escape(k) + r"\s*[(<]", name):
            return k
    low = name.lower()
    if "nccl" in low:
        return "ncclReduceScatter" if "reduce" in low else "ncclAllGather"
    if any(t in low for t in ("gemm", "xmma", "cutlass", "nvjet", "splitk")):
        return "cublasGemmEx"
    return None


def compare_kernels(r, path, runs, out=sys.stdout):
    """Measured per kernel (nsys stats --report cuda_gpu_kern_sum --format csv, over `runs`
    steps) next to the model's rows for the same kernel, per step."""
    import csv
    p = lambda *a: print(*a, file=out)
    known = set()
    for o, _ in r["rows"]:
        known.update(k for k in o.kernel.split("+") if not k.startswith(("cuda", "nccl", "cublas")))
    meas, other = {}, 0.0
    with open(path, encoding="utf-8", newline="") as f:
        lines = [l for l in f if l.count(",") >= 3]
    for row in csv.DictReader(lines):
        name = row.get("Name") or row.get("name") or ""
        ns = row.get("Total Time (ns)") or row.get("Total Time") or "0"
        t = float(ns.replace(",", "")) / 1e6 / runs
        k = kernel_of(name, known)
        if k is None:
            other += t
        else:
            meas[k] = meas.get(k, 0.0) + t
    pred = {}
    for o, t in r["rows"]:
        if o.kind in ("host", "h2d", "d2h") or o.kernel.startswith("cuda"):
            continue
        ks = o.kernel.split("+")
        for k in ks:
            pred[k] = pred.get(k, 0.0) + t * 1e3 / len(ks)
    p(f"== per kernel, ms per step (nsys, {runs} steps): {r['config']} seq {r['seq_len']} on {r['gpu']}")
    p(f"   {'kernel':32s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}")
    for k in sorted(set(pred) | set(meas), key=lambda k: -max(pred.get(k, 0), meas.get(k, 0))):
        a, b = pred.get(k, 0.0), meas.get(k, 0.0)
        p(f"   {k:32s} {a:10.3f} {b:10.3f} {b / a if a else 0:6.2f}")
    p(f"   {'(kernels the model does not name)':32s} {'':10s} {other:10.3f}")
    tot_p = sum(pred.values())
    p(f"   {'all kernels':32s} {tot_p:10.3f} {sum(meas.values()) + other:10.3f}")
    return meas


def to_json(r):
    d = {k: v for k, v in r.items() if k != "rows"}
    d["kernels"] = sorted(model_kernels(r))
    d["ops"] = [dict(g, ms=g["s"] * 1e3) for g in groups(r["rows"])]
    return d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="qwen3-8b, kimi, tiny, or a drafter config.json")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences accumulated per step and GPU (default: the trainer's pick, "
                         "auto_batch: 1, or 4 with several ranks on PCIe GPUs)")
    ap.add_argument("--world", type=int, default=8, help="GPUs (data parallel, ZeRO-1)")
    ap.add_argument("--vocab-chunk", type=int, default=16384)
    ap.add_argument("--attention", default="both", choices=["mma", "wmma", "scalar", "both"],
                    help="the tensor-core kernels (mma; wmma: their former name), the old "
                         "scalar ones, or both (the default)")
    ap.add_argument("--busbw", type=float, metavar="GB/S",
                    help="NCCL bus bandwidth instead of the GPU's stated one (RTX-PRO-6000: 25 "
                         "by default, 15-42 measured on 8-GPU PCIe boxes)")
    ap.add_argument("--rs-bf16", action="store_true",
                    help="the gradient reduce-scatter in bf16 (--grad-reduce-bf16): half its "
                         "bytes, two conversion kernels per bucket")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                    help="the optimizer step to price: AdamW, or Muon on the weight matrices "
                         "(DFLASH_OPTIMIZER_MUON; Newton-Schulz in fp32 on every rank)")
    ap.add_argument("--dflash2", metavar="K,G,TOPK,RANK",
                    help="price a DFlash 2 drafter of this shape: convolutions of kernel size K "
                         "and group size G, the selector's top-K and rank (a config.json with "
                         "DFlash2DraftModel gives them itself)")
    ap.add_argument("--dspark", metavar="RANK", type=int,
                    help="price a DSpark drafter with this Markov rank and the confidence head "
                         "(a config.json with Qwen3DSparkModel gives them itself)")
    ap.add_argument("--draft-vocab", metavar="N", type=int,
                    help="with --dspark: a pruned draft vocabulary of N ids (draft_vocab_size; "
                         "a config.json gives it itself)")
    ap.add_argument("--json", action="store_true",
                    help="one JSON object per design, then a last line with the first design's "
                         "step (mfu_pct, step_ms, attention; all null and `refused` saying why "
                         "when the backend refuses the shape)")
    ap.add_argument("--no-ops", action="store_true", help="totals only")
    ap.add_argument("--markdown", action="store_true", help="the per-op table as Markdown")
    ap.add_argument("--categories", action="store_true", help="a Markdown table per class of op")
    ap.add_argument("--gemms", action="store_true",
                    help="print the step's distinct GEMMs for `gpu_bench gemm` and exit")
    ap.add_argument("--compare", metavar="BENCH_OUT",
                    help="gpu_bench output (json lines): measured next to predicted")
    ap.add_argument("--compare-kernels", metavar="CSV",
                    help="nsys stats --report cuda_gpu_kern_sum --format csv of gpu_bench: "
                         "measured per kernel next to predicted")
    ap.add_argument("--runs", type=int, default=1, help="steps the profile covers")
    a = ap.parse_args(argv)
    if a.batch is None:
        a.batch = auto_batch(a.gpu, a.world)
    global RS_BYTES, MUON
    RS_BYTES = 2 if a.rs_bf16 else 4
    MUON = a.optimizer == "muon"
    if a.busbw:
        GPUS[a.gpu] = dict(GPUS[a.gpu], busbw=a.busbw * 1e9)
    c = load_config(a.config)
    if a.dflash2:
        k, g, K, r = (int(v) for v in a.dflash2.split(","))
        c = dict(c, dflash2=dict(k=k, g=g, K=K, r=r), name=c["name"] + "-dflash2")
    if a.dspark:
        c = dict(c, dspark=dict(r=a.dspark, conf=True), name=c["name"] + "-dspark")
    if a.draft_vocab:
        if not c.get("dspark"):
            raise SystemExit("--draft-vocab prunes a DSpark drafter's vocabulary: give --dspark "
                             "RANK or a DSpark config")
        if not 1 <= a.draft_vocab <= c["vocab_size"]:
            raise SystemExit(f"--draft-vocab {a.draft_vocab}: not in 1..{c['vocab_size']}")
        if a.draft_vocab < c["vocab_size"]:
            c = dict(c, dspark=dict(c["dspark"], vd=a.draft_vocab),
                     name=c["name"] + f"-vd{a.draft_vocab}")
    if a.gemms or a.compare or a.compare_kernels:
        r = model(c, a.gpu, a.seq_len, a.anchors, a.batch, a.world, a.vocab_chunk,
                  "scalar" if a.attention == "scalar" else "mma")
        if a.gemms:
            for g in gemm_calls(r):
                print(f"{g['name']} {g['M']} {g['N']} {g['K']} {g['c_bytes']} {g['beta']:g}")
        elif a.compare:
            compare(r, a.compare)
        else:
            compare_kernels(r, a.compare_kernels, a.runs)
        return 0
    designs = ["mma", "scalar"] if a.attention == "both" else [a.attention]
    # The last --json line: the first design's step (the tensor-core path with "both": what
    # the backend runs; it has no scalar fallback, a shape it refuses has no step).
    chosen, refused = None, None
    for i, dsg in enumerate(designs):
        try:
            r = model(c, a.gpu, a.seq_len, a.anchors, a.batch, a.world, a.vocab_chunk, dsg)
        except Unsupported as e:
            print(f"== {c['name']} on {a.gpu}: {e}")
            refused = refused or (str(e) if i == 0 else None)
            continue
        chosen = r if i == 0 else chosen
        if a.json:
            print(json.dumps(to_json(r)))
        elif a.markdown or a.categories:
            if i == 0:
                (print_markdown if a.markdown else print_categories)(r)
            print_table(r, ops=False)
        else:
            print_table(r, ops=not a.no_ops and i == 0)
    if a.json:
        last = dict(config=c["name"], gpu=a.gpu, world=a.world, batch=a.batch,
                    reduce_scatter="bf16" if a.rs_bf16 else "fp32",
                    busbw_gbs=GPUS[a.gpu]["busbw"] / 1e9, refused=refused,
                    attention=chosen["attention"] if chosen else None,
                    mfu_pct=round(100 * chosen["sched"]["now"]["mfu"], 2) if chosen else None,
                    step_ms=round(chosen["step_s"] * 1e3, 2) if chosen else None)
        print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
