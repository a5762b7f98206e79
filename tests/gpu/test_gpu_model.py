#!/usr/bin/env python3
"""Checks of bench/gpu_model.py (suite unit; no GPU, no timing):

1. its model FLOPs equal an independent count: 6 x (matmul parameters of a layer)
   x block tokens + the context k/v projections + fc (forward and weight gradient)
   + LM head (forward and input gradient) + attention (3 x forward over the visible
   (query, key) pairs, counted pair by pair from ops.c's mask);
2. its parameter count and memory terms equal `dflash train --plan` (src/train/plan.c,
   the arithmetic the CUDA backend allocates with);
3. every kernel the CUDA sources launch (DF_LAUNCH in cuda/*.cu) and every cuBLAS /
   NCCL call of cuda/model.cu, backend.cu, dist.cu and arena.cu has a row in the model, so a new kernel without one fails
   here; the scan itself is shown to find a kernel the model lacks;
4. the reduce-scatter overlapped with the backward: the bucket layout is
   dist.c's, the tensor offsets add up to the parameter count, the exposed tail lies
   between 0 and the whole reduce-scatter, and with one bucket (ready only when the
   backward ends) it is the whole reduce-scatter;
5. the schedules (dflash_trainer_step_async): `now` hides the next step's first host copy +
   upload behind the step's last backward, optimizer and collectives, exactly what of it
   fits there: `sync - now == min(first, behind)`, `overlap <= now <= sync`, and with the
   upload made slow enough to outlast that window, what is left over shows in `now`;
6. DFlash 2 (--dflash2): its parameters add what src/train/README.md states for the plan's
   count (95.0 M at H 2048, L 5, V 163840, k 2, g 16, r 256: 94,978,048), every kernel of
   cuda/dflash2.cu a step launches has a priced row (not only a name), the reduce-scatter
   runs whole after the backward (model.cu does not overlap it for DFlash 2), and the model
   FLOPs grow by the convolutions' kernel projections and the selector;
7. the shared-memory targets: the shared-memory bytes cuda/attention.cu's header states for the
   Kimi and Qwen3-8B packings equal the model's smem_layout (which mirrors the kernel's),
   both fit the RTX PRO 6000's 101,376 bytes per block at N 64, neither shape is refused
   there, and `--json`'s last line names the path taken (a head_dim 256 drafter at 128 rows
   per CTA: refused on sm_120 with the reason, no step: the backend has no other path);
8. the trainer's own sequences per step: gpu_model.py's PCIE_SEQUENCES is
   train/cuda/dfcuda.h's DF_CU_PCIE_SEQUENCES, `dflash train --plan --gpu NAME --world W`
   reports auto_batch(NAME, W) for every GPU both know, with it the defaults predict
   >= 50 % MFU for Kimi and Qwen3-8B on 8 RTX PRO 6000 at 25 GB/s, one sequence fewer
   does not (the count is the smallest that does), and the NVLink GPUs keep one;
9. --rs-bf16 halves the reduce-scatter's bytes and prices its two conversion kernels;
10. --optimizer muon: the Muon matrices are every parameter but the norms (the count from
   param_count), their Newton-Schulz FLOPs are 5 x (4 r^2 c + 2 r^3) per r x c matrix
   (r <= c) on TF32 cublasGemmEx rows, over 8 ranks only the busiest owner's share (the
   owners as cuda/arena.cu assigns them), the results broadcast, Muon's kernels are priced,
   and the model FLOPs do not move;
11. DSpark (--dspark, or a Qwen3DSparkModel config): its parameters and buffers equal the
   plan's (Kimi, rank 256: the arena at A x B rows plus df_cu_dspark_bytes), its kernels are
   priced in place of DFlash's CE, its model FLOPs are the LM head's and the Markov head's,
   and `--plan` states 98 KiB of hidden states per token (84 and the final state); with a
   pruned draft vocabulary (--draft-vocab, or draft_vocab_size) W2 has V_d rows, the draft
   logits and d(z) passes are V_d wide while the target's logits stay V wide, and the
   buffers (the kept rows of the head and their ids among them) equal the plan's.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_model as gm  # noqa: E402

FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


# ---- 1. FLOPs -------------------------------------------------------------------------
def visible_pairs_bruteforce(c, anchors, Sc, window):
    """(query, key) pairs per query head as ops.c visible() defines them: key by key for
    sliding layers, in closed form for full ones."""
    B, n = c["block_size"], 0
    if window <= 0:  # every context row before the anchor and the whole block
        return sum((min(a, Sc) + B) * B for a in anchors)
    for a in anchors:
        hi = min(a, Sc)
        for j in range(B):
            for key in range(hi):  # context rows
                n += window <= 0 or key >= a + j - (window - 1)
            for p in range(B):     # block rows
                n += window <= 0 or (j - (window - 1) <= p <= j)
    return n


def independent_flops(c, s):
    H, I, d, L = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    nh, nkv, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    KH = H * len(c["target_layer_ids"])
    layer_matmul = nh * d * H * 2 + nkv * d * H * 2 + 3 * I * H  # q, o, k, v, gate/up/down
    f = 6.0 * s.T * L * layer_matmul
    f += 6.0 * s.Sc * L * 2 * nkv * d * H  # context keys/values (same k/v weights)
    f += 4.0 * s.Sc * KH * H               # fc: forward + dW (its input is frozen)
    f += 4.0 * s.R * V * H                 # LM head: forward + d(rows) (frozen weight)
    for l in range(L):
        f += 3 * 4.0 * d * nh * visible_pairs_bruteforce(c, s.anchors, s.Sc, c["window"][l])
    return f


def sliding_config(path):
    cfg = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=16, vocab_size=300, block_size=8,
               sliding_window=24, use_sliding_window=True,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               dflash_config={"mask_token_id": 299, "target_layer_ids": [0, 2]})
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def test_flops(tmp):
    cases = [("qwen3-8b", 3072, 512), ("kimi", 3072, 512), ("tiny", 64, 8),
             (sliding_config(os.path.join(tmp, "sliding.json")), 200, 12)]
    for name, seq, A in cases:
        c = gm.load_config(name)
        s = gm.Seq(c, seq, A)
        ind = independent_flops(c, s)
        for design in ("mma", "scalar"):
            r = gm.model(c, "H200", seq, A, 1, 1, 16384, design)
            check(close(r["model_flops"], ind), f"{os.path.basename(name)} {design}: model FLOPs "
                  f"{r['model_flops']:.6e} == independent count {ind:.6e}")
            check(r["exec_flops"] >= r["model_flops"] * 0.999,
                  f"{os.path.basename(name)} {design}: executed FLOPs >= model FLOPs")
        # batch scales the per-sequence work, world only the optimizer and collectives
        r2 = gm.model(c, "H200", seq, A, 3, 1, 16384, "mma")
        check(close(r2["model_flops"], 3 * ind), f"{os.path.basename(name)}: batch 3 = 3x FLOPs")


# ---- 2. against dflash train --plan ---------------------------------------------------
def plan(cli, cfg_path, world, seq, anchors, chunk):
    out = subprocess.run([cli, "train", "--plan", "--config", cfg_path, "--world", str(world),
                          "--seq-len", str(seq), "--anchors", str(anchors), "--vocab-chunk",
                          str(chunk), "--gpu-gb", "100000"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"dflash train --plan failed: {out.stdout}{out.stderr}")
    txt = out.stdout
    n = int(re.search(r"(\d+) trainable parameters", txt).group(1))
    gib = {k: float(re.search(re.escape(k) + r"[^\n]*?\s([\d.]+) GiB", txt).group(1))
           for k in ("weights (bf16)", "master weights", "AdamW moments", "gradients",
                     "activations", "frozen embedding")}
    return n, gib


def builtin_json(name, path):
    c = gm.BUILTIN[name]
    j = dict((k, c[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "vocab_size", "block_size"))
    j["num_target_layers"] = max(c["target_layer_ids"]) + 2
    j["dflash_config"] = {"mask_token_id": c["vocab_size"] - 2,
                          "target_layer_ids": c["target_layer_ids"]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f)
    return path


def check_activations(what, m, plan_gib, extra=0):
    """The plan's "activations" is the model's arena (+ `extra` bytes beside it, DSpark's
    buffers), or (once plan.c counts them) that with the fixed scratch the backend keeps."""
    arena, fixed = (m["activations"] + extra) / 2**30, (m["staging"] + m["scratch"]) / 2**30
    check(min(abs(arena - plan_gib), abs(arena + fixed - plan_gib)) <= 0.006,
          f"{what}: activations {arena:.3f} GiB (+ scratch {fixed:.3f}) == plan's {plan_gib:.2f}")


def test_plan(tmp):
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        print("skip plan comparison: DFLASH_CLI not set")
        return
    for name, world, seq, A, chunk in (("qwen3-8b", 1, 3072, 512, 16384), ("kimi", 8, 3072, 512, 8192),
                                       ("tiny", 2, 64, 8, 100)):
        path = builtin_json(name, os.path.join(tmp, name + ".json"))
        n, g = plan(cli, path, world, seq, A, chunk)
        c = gm.load_config(name)
        check(n == gm.param_count(c), f"{name}: parameters {gm.param_count(c)} == plan's {n}")
        m = gm.memory(c, n, world, seq, A, chunk)
        for key, plan_key in (("weights", "weights (bf16)"), ("masters", "master weights"),
                              ("moments", "AdamW moments"), ("grads", "gradients"),
                              ("frozen", "frozen embedding")):
            ours = m[key] / 2**30
            check(abs(ours - g[plan_key]) <= 0.006, f"{name} world {world}: {key} {ours:.3f} GiB "
                  f"== plan's {g[plan_key]:.2f}")
        check_activations(f"{name} world {world}", m, g["activations"])


def test_plan_dspark(tmp):
    """The Kimi shape as a DSpark drafter (rank 256, confidence head): the plan's parameters,
    its activations (the arena at R = A x B rows plus df_cu_dspark_bytes) and the hidden
    states per token it states (K + 1 layers' worth: the target's final state)."""
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        print("skip DSpark plan comparison: DFLASH_CLI not set")
        return
    path = builtin_json("kimi", os.path.join(tmp, "kimi-dspark.json"))
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j.update(architectures=["Qwen3DSparkModel"], markov_rank=256, markov_head_type="vanilla",
             enable_confidence_head=True, confidence_head_with_markov=True,
             sample_from_anchor=True, tie_word_embeddings=False)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f)
    n, g = plan(cli, path, 8, 3072, 512, 8192)
    c = gm.load_config(path)
    check(c["dspark"] == dict(r=256, conf=True), f"gpu_model reads the DSpark keys: {c['dspark']}")
    check(n == gm.param_count(c), f"kimi DSpark: parameters {gm.param_count(c)} == plan's {n}")
    m = gm.memory(c, n, 8, 3072, 512, 8192)
    check_activations("kimi DSpark: arena + DSpark buffers", m, g["activations"], m["dspark"])
    # Pruned to 32768 ids: W2 [V_d, r], the V_d-wide logit buffers, the kept rows and ids.
    j["draft_vocab_size"] = 32768
    pruned = os.path.join(tmp, "kimi-dspark-vd.json")
    with open(pruned, "w", encoding="utf-8") as f:
        json.dump(j, f)
    n2, g2 = plan(cli, pruned, 8, 3072, 512, 8192)
    c2 = gm.load_config(pruned)
    check(c2["dspark"] == dict(r=256, conf=True, vd=32768),
          f"gpu_model reads draft_vocab_size: {c2['dspark']}")
    check(n2 == gm.param_count(c2) and n - n2 == (c["vocab_size"] - 32768) * 256,
          f"kimi DSpark V_d 32768: parameters {gm.param_count(c2)} == plan's {n2}, "
          f"{n - n2} fewer (W2's rows)")
    m2 = gm.memory(c2, n2, 8, 3072, 512, 8192)
    check_activations("kimi DSpark V_d 32768: arena + DSpark buffers", m2, g2["activations"],
                      m2["dspark"])
    check(abs(m2["frozen"] - m["frozen"]) == 0 and g2["frozen embedding"] == g["frozen embedding"],
          "kimi DSpark V_d 32768: the frozen embedding and full LM head stay")
    out = subprocess.run([cli, "train", "--plan", "--config", path, "--world", "8", "--gpu-gb",
                          "100000"], capture_output=True, text=True).stdout
    kib = re.search(r"hidden states per token\s+([\d.]+) KiB bf16", out)
    want = 2 * (len(c["target_layer_ids"]) + 1) * c["hidden_size"] / 1024
    check(kib is not None and abs(float(kib.group(1)) - want) < 0.05,
          f"kimi DSpark: hidden states per token {kib and kib.group(1)} KiB == {want:.1f} "
          "(6 layers and the final state, bf16)")


# ---- 3. every kernel has a row --------------------------------------------------------
def launched_kernels(text):
    """Kernel names of DF_LAUNCH(grid, block, smem, stream, kernel<...>)(args): the last
    top-level argument, template arguments dropped."""
    names, i = set(), 0
    while True:
        i = text.find("DF_LAUNCH(", i)
        if i < 0:
            return names
        j, depth, args, cur = i + len("DF_LAUNCH("), 1, [], ""
        while depth:
            ch = text[j]
            if ch in "(<[":
                depth += ch == "("
                cur += ch
                if ch == "<":
                    k = text.index(">", j)
                    cur += text[j + 1:k + 1]
                    j = k
            elif ch == ")":
                depth -= 1
                if depth:
                    cur += ch
            elif ch == "," and depth == 1:
                args.append(cur)
                cur = ""
            else:
                cur += ch
            j += 1
        args.append(cur)
        names.add(re.sub(r"<.*", "", args[-1]).strip())
        i = j


def test_kernels():
    srcs = {}
    cuda = os.path.join(ROOT, "cuda")
    for f in sorted(os.listdir(cuda)):
        if f.endswith(".cu"):
            with open(os.path.join(cuda, f), encoding="utf-8") as fh:
                srcs[f] = fh.read()
    launched = set()
    for f, text in srcs.items():
        launched |= launched_kernels(text)
    check(len(launched) >= 20, f"found {len(launched)} launched kernels in cuda/*.cu")
    have = gm.model_kernels(gm.model(gm.load_config("tiny"), "H200", 64, 8, 1, 2, 100, "mma")) | \
        gm.model_kernels(gm.model(gm.load_config("tiny"), "H200", 64, 8, 1, 2, 100, "scalar"))
    missing = sorted(launched - have)
    check(not missing, "every DF_LAUNCH kernel has a model row" +
          (f"; missing: {', '.join(missing)}" if missing else ""))
    # The model's files (model.cuh names them): forward and backward, the step, NCCL, uploads.
    model_files = ("model.cu", "backend.cu", "dist.cu", "arena.cu")
    calls = set(re.findall(r"\b(cublasGemmEx|ncclReduceScatter|ncclAllGather|ncclAllReduce|"
                           r"ncclBroadcast|cudaMemcpyAsync|cudaMemsetAsync)\(",
                           "".join(srcs.get(f, "") for f in model_files)))
    check(all(f in srcs for f in model_files) and len(calls) == 7,
          f"the model's files hold its cuBLAS, NCCL and copy calls: {sorted(calls)}")
    check(calls <= have, f"the model's cuBLAS/NCCL/copy calls {sorted(calls)} have rows")
    # The scan can fail: a launch of a kernel the model does not know is found.
    fake = "DF_LAUNCH(dim3((n + 1) / 2, g), 128, smem, st, attn_new_thing<bf16, 64>)(x);"
    check(launched_kernels(fake) == {"attn_new_thing"} and "attn_new_thing" not in have,
          "negative control: an unknown kernel is reported")


def test_kernel_names(tmp):
    """nsys's demangled names map to the model's kernels (gpu_check.sh's per-kernel table)."""
    known = {"attention_backward_ctx", "attention_backward_q", "rmsnorm_backward", "rmsnorm_forward", "rmsnorm_backward_dw_partial"}
    cases = {
        "(anonymous namespace)::attention_backward_ctx((anonymous namespace)::Shape, int, float *)": "attention_backward_ctx",
        "void (anonymous namespace)::rmsnorm_backward<__nv_bfloat16, float>(float *, long, int, bool)": "rmsnorm_backward",
        "void (anonymous namespace)::rmsnorm_backward_dw_partial<float>(float *, const float *)": "rmsnorm_backward_dw_partial",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas": "cublasGemmEx",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, float>(float *)": "cublasGemmEx",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm *)": "ncclReduceScatter",
        "some_other_kernel(int)": None,
    }
    for name, want in cases.items():
        got = gm.kernel_of(name, known)
        check(got == want, f"nsys name -> {want}: {got}")
    csv = os.path.join(tmp, "k.csv")
    with open(csv, "w", encoding="utf-8") as f:
        f.write('Generating SQLite file\n"Time (%)","Total Time (ns)","Instances","Name"\n'
                '50.0,"3,000,000",3,"(anonymous namespace)::attention_forward((anonymous namespace)::Shape)"\n')
    r = gm.model(gm.load_config("tiny"), "H200", 64, 8, 1, 1, 100, "mma")
    with open(os.devnull, "w", encoding="utf-8") as null:
        meas = gm.compare_kernels(r, csv, 3, out=null)
    check(abs(meas.get("attention_forward", 0) - 1.0) < 1e-9, "a profile's total over 3 runs is 1 ms per step")


def test_overlap():
    for name in ("qwen3-8b", "kimi"):
        c = gm.load_config(name)
        n, world = gm.param_count(c), 8
        b = gm.buckets(n, world)
        npad = -(-n // world) * world
        ok = sum(k for _, k in b) == npad and b[0][0] + b[0][1] == npad and b[-1][0] == 0
        ok = ok and all(k % world == 0 and k <= gm.BUCKET_ELEMS for _, k in b)
        ok = ok and all(b[i + 1][0] + b[i + 1][1] == b[i][0] for i in range(len(b) - 1))
        check(ok and len(b) > c["num_hidden_layers"], f"{name}: {len(b)} buckets tile the "
              "padded buffer from its end, each a multiple of the world")
        norm_off, layer_off = gm.tensor_starts(c)
        check(norm_off + c["hidden_size"] == n and layer_off[0] < layer_off[-1] < norm_off,
              f"{name}: the final norm ends the parameter table")
        r = gm.model(c, "H200", 3072, 512, 1, world, 16384, "mma")
        e, rs = r["reduce_scatter_exposed_s"], r["reduce_scatter_s"]
        check(0 < e < rs, f"{name}: reduce-scatter {rs * 1e3:.1f} ms, {e * 1e3:.1f} ms past the "
              "backward")
        check(gm.model(c, "H200", 3072, 512, 1, 1, 16384, "mma")["reduce_scatter_exposed_s"] == 0,
              f"{name}: nothing to reduce on one GPU")
    saved = gm.BUCKET_ELEMS
    gm.BUCKET_ELEMS = 1 << 40  # one bucket: ready only once fc's dW is done
    try:
        r = gm.model(gm.load_config("qwen3-8b"), "H200", 3072, 512, 1, 8, 16384, "mma")
    finally:
        gm.BUCKET_ELEMS = saved
    check(close(r["reduce_scatter_exposed_s"], r["reduce_scatter_s"]),
          "one bucket: the whole reduce-scatter runs after the backward")


def test_schedules():
    for name in ("qwen3-8b", "kimi"):
        c = gm.load_config(name)
        for world, batch in ((8, 1), (1, 1), (8, 4)):
            r = gm.model(c, "H200", 3072, 512, batch, world, 16384, "mma")
            s = {k: v["step_s"] for k, v in r["sched"].items()}
            first, behind = r["first_upload_s"], r["first_behind_s"]
            check(close(s["sync"] - s["now"], min(first, behind)) and
                  s["overlap"] <= s["now"] + 1e-12 <= s["sync"] + 1e-12,
                  f"{name} world {world} batch {batch}: step {s['sync'] * 1e3:.1f} ms waiting for "
                  f"the norm, {s['now'] * 1e3:.1f} ms with the first upload ({first * 1e3:.1f} "
                  f"ms) behind {behind * 1e3:.1f} ms")
            check(behind > first, f"{name} world {world} batch {batch}: the first upload fits "
                  "behind the step before (so `now` hides it whole)")
    saved = gm.PCIE_BW
    gm.PCIE_BW = 1e9  # an upload slower than the step before it
    try:
        r = gm.model(gm.load_config("qwen3-8b"), "H200", 3072, 512, 1, 8, 16384, "mma")
    finally:
        gm.PCIE_BW = saved
    first, behind = r["first_upload_s"], r["first_behind_s"]
    left = r["sched"]["now"]["step_s"] - r["sched"]["overlap"]["step_s"]
    check(first > behind and left > 0 and close(r["sched"]["sync"]["step_s"] -
                                                  r["sched"]["now"]["step_s"], behind),
          f"a slow upload ({first * 1e3:.0f} ms): {behind * 1e3:.0f} ms of it hidden, the rest "
          "exposed")


def test_dflash2():
    c = dict(gm.load_config("qwen3-8b"), hidden_size=2048, num_hidden_layers=5, vocab_size=163840)
    d2 = dict(c, dflash2=dict(k=2, g=16, K=32, r=256))
    check(gm.param_count(d2) - gm.param_count(c) == 94978048,
          f"DFlash 2 adds {gm.param_count(d2) - gm.param_count(c)} parameters (the plan: 95.0 M)")
    q = gm.load_config("qwen3-8b")
    q2 = dict(q, dflash2=dict(k=2, g=16, K=32, r=256))
    r1 = gm.model(q, "H200", 3072, 512, 1, 8, 16384, "mma")
    r2 = gm.model(q2, "H200", 3072, 512, 1, 8, 16384, "mma")
    priced = set()
    for o, t in r2["rows"]:
        if t > 0:
            priced.update(o.kernel.split("+"))
    want = set(gm.dflash2_kernels()) - {"df2_select_greedy_block"}
    check(want <= priced, "every DFlash 2 kernel of a step has a priced row; missing: "
          f"{sorted(want - priced)}")
    check(close(r2["reduce_scatter_exposed_s"], r2["reduce_scatter_s"]) and
          r1["reduce_scatter_exposed_s"] < r1["reduce_scatter_s"],
          "DFlash 2: the reduce-scatter after the backward, whole")
    H, T, R = q["hidden_size"], r2["T"], r2["R"]
    kg2, L = 2 * 2 * (H // 16), q["num_hidden_layers"]
    extra = L * 2 * 3 * 2.0 * T * kg2 * H  # kernel projection: forward, dx, dw per conv
    extra += 3 * 2.0 * R * 256 * H + 2.0 * R * (32 + 1) * 256  # hidden projection, codebooks
    check(close(r2["model_flops"] - r1["model_flops"], extra),
          f"DFlash 2 model FLOPs +{(r2['model_flops'] - r1['model_flops']) / 1e12:.3f} TFLOP")
    check("dflash2" in r2["memory"] and r2["memory"]["dflash2"] > 0, "DFlash 2's buffers counted")


def test_dspark():
    """DSpark (--dspark): the plan's parameters (tests/train/test_dspark_model.c: 2 V r + H +
    r + 1 over DFlash), every DSpark kernel priced, every slot a supervised row, its buffers
    (src/train/cuda/dfcuda.h df_cu_dspark_bytes) counted."""
    q = gm.load_config("qwen3-8b")
    ds = dict(q, dspark=dict(r=256, conf=True))
    H, V = q["hidden_size"], q["vocab_size"]
    check(gm.param_count(ds) - gm.param_count(q) == 2 * V * 256 + H + 256 + 1,
          f"DSpark adds {gm.param_count(ds) - gm.param_count(q)} parameters")
    r1 = gm.model(q, "H200", 3072, 512, 1, 8, 16384, "mma")
    r2 = gm.model(ds, "H200", 3072, 512, 1, 8, 16384, "mma")
    priced = set()
    for o, t in r2["rows"]:
        if t > 0:
            priced.update(o.kernel.split("+"))
    want = set(gm.dspark_kernels())
    check(want <= priced and not priced & {"lmhead_ce_chunk", "lmhead_ce_finish"},
          f"every DSpark kernel priced, DFlash's CE not run; missing {sorted(want - priced)}")
    check(r2["R"] == r2["T"] and r1["R"] < r1["T"], f"DSpark supervises all {r2['T']} slots")
    B, r = q["block_size"], 256
    want_bytes = 512 * B * (4 + 2 * H + 2 * r + 4) + 64 * (V * 10 + 4 * r)
    check(r2["memory"].get("dspark") == want_bytes,
          f"DSpark's buffers {r2['memory'].get('dspark')} == df_cu_dspark_bytes {want_bytes}")
    # DFlash's LM head (logits, d(rows)) replaced by DSpark's: logits, d(rows) and the Markov
    # head's bias, d(e) and dW2; the target's logits are not model FLOPs
    R1, R2 = r1["R"], r2["R"]
    extra = 4.0 * R2 * V * H + 6.0 * R2 * V * r - 4.0 * R1 * V * H
    check(close(r2["model_flops"] - r1["model_flops"], extra),
          f"DSpark model FLOPs {(r2['model_flops'] - r1['model_flops']) / 1e12:+.3f} TFLOP "
          f"(want {extra / 1e12:+.3f})")
    # A pruned draft vocabulary (V_d 32768): W2 has V_d rows; the draft logits, d(z) and the
    # Markov head's GEMMs are V_d wide, the target's logits stay V wide.
    Vd = 32768
    dp = dict(q, dspark=dict(r=256, conf=True, vd=Vd))
    check(gm.param_count(dp) - gm.param_count(q) == (V + Vd) * 256 + H + 256 + 1,
          f"pruned DSpark adds {gm.param_count(dp) - gm.param_count(q)} parameters")
    r3 = gm.model(dp, "H200", 3072, 512, 1, 8, 16384, "mma")
    shapes = {o.name.split(" (")[0]: (o.extra["M"], o.extra["N"], o.extra["K"])
              for o, _ in r3["rows"] if o.name.startswith("DSpark") and o.kind == "gemm"}
    want_shapes = {"DSpark draft logits x E^T": (R2, Vd, H),
                   "DSpark Markov bias e W2^T": (R2, Vd, r),
                   "DSpark target logits xt E^T": (R2, V, H),
                   "DSpark d(rows) = dz E": (R2, H, Vd), "DSpark d(e) = dz W2": (R2, r, Vd),
                   "DSpark dW2 += dz^T e": (Vd, r, R2)}
    check(shapes == want_shapes, f"pruned DSpark GEMMs: {shapes}")
    want_bytes = (512 * B * (4 + 2 * H + 2 * r + 4) + 64 * (Vd * 6 + V * 4 + 4 * r) +
                  Vd * (2 * H + 4))
    check(r3["memory"].get("dspark") == want_bytes,
          f"pruned DSpark's buffers {r3['memory'].get('dspark')} == df_cu_dspark_bytes "
          f"{want_bytes}")
    extra3 = 4.0 * R2 * Vd * H + 6.0 * R2 * Vd * r - 4.0 * R1 * V * H
    check(close(r3["model_flops"] - r1["model_flops"], extra3),
          f"pruned DSpark model FLOPs {(r3['model_flops'] - r1['model_flops']) / 1e12:+.3f} "
          f"TFLOP (want {extra3 / 1e12:+.3f})")
    check(r3["step_s"] < r2["step_s"], f"pruned DSpark step {r3['step_s'] * 1e3:.1f} ms < full "
          f"{r2['step_s'] * 1e3:.1f}")


def test_targets(tmp):
    src = open(os.path.join(ROOT, "cuda", "attention.cu")).read()
    m = re.search(r"e\.g\. d 128 \(ld 128\), Mp 128 .*?N 64: ([\d,]+) / ([\d,]+) / ([\d,]+) bytes"
                  r".*?Mp 64 \(Qwen3-8B 32/8\): ([\d,]+) / ([\d,]+) / ([\d,]+)\.", src, re.S)
    check(m is not None, "attention.cu's header states the bytes of both packings")
    if m:
        stated = [int(v.replace(",", "")) for v in m.groups()]
        model = [gm.smem_layout(k, Mp, 64, 128) for Mp in (128, 64)
                 for k in ("fwd", "bwd_q", "bwd_kv")]
        check(stated == model, f"header bytes {stated} == smem_layout {model}")
        check(max(model) <= gm.GPUS["RTX-PRO-6000"]["smem_block"], "all fit sm_120 at N 64")
    for name in ("kimi", "qwen3-8b"):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_model.py"), name,
                              "--gpu", "RTX-PRO-6000", "--world", "8", "--json"],
                             capture_output=True, text=True, check=True).stdout
        last = json.loads(out.strip().splitlines()[-1])
        check({"mfu_pct", "step_ms", "attention", "refused"} <= set(last),
              f"{name}: --json's last line has mfu_pct, step_ms, attention, refused")
        check(last.get("attention") == "mma" and last.get("refused") is None
              and last.get("busbw_gbs") == 25.0 and last.get("mfu_pct", 0) > 0,
              f"{name} on RTX-PRO-6000: tensor cores, not refused, 25 GB/s: {last}")
    big = dict(json.load(open(builtin_json("kimi", os.path.join(tmp, "k256.json")))),
               head_dim=256)
    with open(os.path.join(tmp, "k256.json"), "w") as f:
        json.dump(big, f)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_model.py"),
                          os.path.join(tmp, "k256.json"), "--gpu", "RTX-PRO-6000", "--json"],
                         capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    check(last.get("attention") is None and last.get("mfu_pct") is None
          and "shared memory" in (last.get("refused") or ""),
          f"head_dim 256 at 128 rows on sm_120: refused, no step: {last}")


# ---- 8. the trainer's sequences per step -----------------------------------------------
def cli_sequences(cli, cfg_path, gpu, world):
    out = subprocess.run([cli, "train", "--plan", "--config", cfg_path, "--gpu", gpu,
                          "--world", str(world), "--gpu-gb", "100000"],
                         capture_output=True, text=True)
    m = re.search(r"sequences per GPU per step: (\d+)", out.stdout)
    return int(m.group(1)) if m else None


def predicted(name, gpu, *extra):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_model.py"), name,
                          "--gpu", gpu, "--world", "8", "--json", *extra],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_auto_batch(tmp):
    hdr = open(os.path.join(ROOT, "src", "train", "cuda", "dfcuda.h")).read()
    m = re.search(r"#define DF_CU_PCIE_SEQUENCES (\d+)", hdr)
    check(m is not None and int(m.group(1)) == gm.PCIE_SEQUENCES,
          f"DF_CU_PCIE_SEQUENCES {m and m.group(1)} == gpu_model.PCIE_SEQUENCES "
          f"{gm.PCIE_SEQUENCES}")
    for name in ("kimi", "qwen3-8b"):
        last = predicted(name, "RTX-PRO-6000")
        check(last["batch"] == gm.PCIE_SEQUENCES and last["mfu_pct"] >= 50.0
              and last["refused"] is None,
              f"{name} on 8 RTX-PRO-6000 at 25 GB/s, the trainer's {last['batch']} sequences: "
              f"{last['mfu_pct']} % MFU >= 50")
        h = predicted(name, "H200")
        check(h["batch"] == 1, f"{name} on 8 H200: one sequence per step ({h['batch']})")
    fewer = [predicted(n, "RTX-PRO-6000", "--batch", str(gm.PCIE_SEQUENCES - 1))["mfu_pct"]
             for n in ("kimi", "qwen3-8b")]
    check(min(fewer) < 50.0, f"{gm.PCIE_SEQUENCES - 1} sequences fall short somewhere: {fewer}")
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        print("skip plan's sequences per step: DFLASH_CLI not set")
        return
    path = builtin_json("kimi", os.path.join(tmp, "kimi-seq.json"))
    for cli_name, gm_name in (("h200", "H200"), ("b200", "B200"), ("b300", "B300"),
                              ("rtx-pro-6000", "RTX-PRO-6000")):
        for world in (1, 8):
            got = cli_sequences(cli, path, cli_name, world)
            check(got == gm.auto_batch(gm_name, world),
                  f"--plan --gpu {cli_name} --world {world}: {got} sequences per step == "
                  f"auto_batch {gm.auto_batch(gm_name, world)}")


def test_rs_bf16():
    """--rs-bf16 (dflash train --grad-reduce-bf16): half the reduce-scatter's bytes, the two conversion
    kernels of cuda/dist.cu priced per bucket, and no other change to the step."""
    c = gm.load_config("kimi")
    f32 = gm.model(c, "RTX-PRO-6000", 3072, 512, 4, 8, 16384, "mma")
    gm.RS_BYTES = 2
    try:
        b16 = gm.model(c, "RTX-PRO-6000", 3072, 512, 4, 8, 16384, "mma")
    finally:
        gm.RS_BYTES = 4
    rs = lambda r: sum(o.bytes * o.count for o, _ in r["rows"] if o.kernel == "ncclReduceScatter")
    check(close(rs(b16), rs(f32) / 2), f"bf16 reduce-scatter bytes {rs(b16):.4g} = half {rs(f32):.4g}")
    kern = {o.kernel for o, _ in b16["rows"]} - {o.kernel for o, _ in f32["rows"]}
    check(kern == {"f32_to_bf16", "bf16_to_f32"}, f"its conversion kernels priced: {sorted(kern)}")
    check(b16["step_s"] < f32["step_s"] and close(b16["model_flops"], f32["model_flops"]),
          f"step {b16['step_s'] * 1e3:.1f} ms < fp32's {f32['step_s'] * 1e3:.1f} at 25 GB/s")
    src = open(os.path.join(ROOT, "cuda", "dist.cu")).read()
    check("ncclBfloat16, ncclSum" in src and "k_bf16_to_f32" in src,
          "cuda/dist.cu reduce-scatters in bf16 and widens the slice, as priced")


def test_muon():
    """--optimizer muon (cuda/backend.cu muon_step): the matrices, the Newton-Schulz FLOPs of
    the busiest rank's matrices (cuda/arena.cu assign_muon_owners) on TF32 rows, the
    broadcast and the kernels priced."""
    c = gm.load_config("qwen3-8b")
    H, L, d = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    adam = gm.model(c, "H200", 3072, 512, 1, 8, 16384, "mma")
    gm.MUON = True
    try:
        muon = gm.model(c, "H200", 3072, 512, 1, 8, 16384, "mma")
        one = gm.model(c, "H200", 3072, 512, 1, 1, 16384, "mma")
    finally:
        gm.MUON = False
    mats = gm.muon_matrices(c)
    norms = H + L * (2 * H + 2 * d) + H  # hidden norm, per layer 2 norms + q/k norms, final
    check(sum(r * k for r, k in mats) == gm.param_count(c) - norms and len(mats) == 1 + 7 * L,
          f"{len(mats)} Muon matrices hold every parameter but the {norms} of the norms")
    cost = [5 * (4 * min(r, k) ** 2 * max(r, k) + 2 * min(r, k) ** 3) for r, k in mats]
    tf = lambda r: sum(o.flops * o.count for o, _ in r["rows"] if o.extra.get("tf32"))
    check(close(tf(one), sum(cost)), f"world 1: Newton-Schulz on TF32 rows {tf(one):.6g} FLOPs "
          f"= 5 (4 r^2 c + 2 r^3) summed {sum(cost):.6g}")
    # The owners, recomputed here as cuda/arena.cu does: largest first, to the least loaded.
    load = [0.0] * 8
    for x in sorted(cost, reverse=True):
        load[load.index(min(load))] += x
    check(close(tf(muon), max(load)) and tf(muon) < sum(cost) / 7,
          f"world 8: the busiest rank's Newton-Schulz {tf(muon):.6g} FLOPs = {max(load):.6g}, "
          f"under 1/7 of {sum(cost):.6g}")
    ns = [o for o, _ in muon["rows"] if o.extra.get("tf32")]
    check(all(o.kernel == "cublasGemmEx" for o in ns) and
          gm.gemm_time(ns[0], gm.GPUS["H200"]) < ns[0].flops / gm.GPUS["H200"]["fp32"],
          "Newton-Schulz on cublasGemmEx rows, faster than the fp32 peak allows")
    bc = sum(o.bytes for o, _ in muon["rows"] if o.kernel == "ncclBroadcast")
    check(close(bc, 4 * sum(r * k for r, k in mats)), f"the results broadcast: {bc:.6g} bytes")
    kern = {o.kernel for o, _ in muon["rows"]} - {o.kernel for o, _ in adam["rows"]}
    check(kern == {"muon_momentum", "muon_normalize", "muon_apply", "ncclBroadcast"},
          f"Muon's kernels priced: {sorted(kern)}")
    check(close(muon["model_flops"], adam["model_flops"]) and muon["step_s"] > adam["step_s"],
          f"model FLOPs unchanged; step {muon['step_s'] * 1e3:.0f} ms against AdamW's "
          f"{adam['step_s'] * 1e3:.0f}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        test_auto_batch(tmp)
        test_rs_bf16()
        test_muon()
        test_flops(tmp)
        test_plan(tmp)
        test_kernels()
        test_kernel_names(tmp)
        test_overlap()
        test_schedules()
        test_dflash2()
        test_dspark()
        test_plan_dspark(tmp)
        test_targets(tmp)
    r = gm.model(gm.load_config("qwen3-8b"), "H200", 3072, 512, 1, 8, 16384, "mma")
    gm.print_table(r, ops=False)
    if FAILS:
        print(f"{len(FAILS)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
