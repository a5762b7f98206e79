#!/usr/bin/env python3
"""The trainer's throughput from a spool against the same run from an offline store: the demo's
drafter shape (SmolLM2-135M's: hidden 576, 1 layer, 9/3 heads, vocab 49152, target layers
1,14,27, block 8, 8 anchors), the CPU backend, the same samples in the same order, one run.

    DFLASH_LIBRARY=BUILD/libdflash.so PYTHONPATH=bindings/python \\
        python3 bench/spool_train.py --cli BUILD/tools/dflash/dflash [--samples 96] [--epochs 2]
        [--reps 3] [--threads 1] [--s3] [--concurrent]

Synthetic data (random tokens, random bf16 hidden states, a random target embedding): the
throughput of a step does not depend on the values. Steps:
  1. `dflash train --hidden STORE` (the offline store) with DFLASH_TRAIN_TRACE: the sample order;
  2. the spool is filled with those samples in that order by bindings/python/tests/
     spool_producer.py (a producer that keeps up: it republishes the store's samples, and by
     default has published every epoch before the trainer starts; --concurrent runs it beside
     the trainer with a budget of a quarter of an epoch instead: on a small machine the two
     then share the cores), a local folder, or an s3:// prefix on moto on loopback with --s3;
  3. `dflash train --hidden spool:...`; both runs alternate --reps times.
Throughput: tokens of steps 2..N over the elapsed time between step 1 and step N (metrics.jsonl),
so that start-up (loading the target) is not counted; the whole run's tokens / elapsed_s is
printed too, and tokens per CPU-second of the trainer process (user + system: the figure that
other load on the machine disturbs least). The two runs must end at the same checkpoint
(checked). The readers alone: the CPU-seconds per token of reading every sample of an epoch
through the offline sample stream and through the spool consumer (float32 rows and their checks,
as the CPU trainer gets them), and from those and the trainer's CPU per token the throughput
ratio they predict for a trainer bound by its CPU: the part of the comparison that the
machine's other load cannot blur.
"""
import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "bindings" / "python"))
import libdflash  # noqa: E402
from libdflash.hidden import write_dataset  # noqa: E402

PRODUCER = ROOT / "bindings" / "python" / "tests" / "spool_producer.py"
# SmolLM2-135M-Instruct as examples/pipeline/pipeline.py's drafter_config makes it.
H, FFN, HEADS, KV, VOCAB, LAYERS, BLOCK = 576, 1536, 9, 3, 49152, 30, 8
TARGET_LAYERS = [1, 14, 27]


def make_world(root, n, rng):
    lens = rng.integers(64, 160, size=n)  # the demo's answers: ~105 tokens a sample
    samples = [(f"s{i:04d}", rng.integers(0, VOCAB - 1, size=int(s)).astype(np.int32),
                np.concatenate([np.zeros(8, np.uint8), np.ones(int(s) - 8, np.uint8)]))
               for i, s in enumerate(lens)]
    write_dataset(root / "train", samples)
    K = len(TARGET_LAYERS)
    with libdflash.HiddenWriter(root / "store", num_layers=K, hidden_size=H) as w:
        for sid, ids, _ in samples:
            w.append(sid, rng.standard_normal((len(ids), K * H), dtype=np.float32))
    (root / "target").mkdir()
    libdflash.write_safetensors(root / "target" / "model.safetensors", {
        "model.embed_tokens.weight": (0.02 * rng.standard_normal((VOCAB, H))).astype(np.float32)})
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": H // HEADS, "vocab_size": VOCAB,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "num_target_layers": LAYERS, "block_size": BLOCK, "tie_word_embeddings": True,
           "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": TARGET_LAYERS}}
    (root / "drafter.json").write_text(json.dumps(cfg))
    return int(lens.sum()) * K * H * 2


def train(cli, root, hidden, out, a, env):
    cmd = [cli, "train", "--config", root / "drafter.json", "--target", root / "target",
           "--data", root / "train", "--hidden", hidden, "-o", out, "--overwrite",
           "--threads", a.threads, "--batch", 4, "--anchors", 8, "--lr", "3e-3", "--seed", 0,
           "--epochs", a.epochs, "--quiet", "--spool-wait", 120]
    if not hidden.startswith("spool:"):
        cmd = cmd[:-2]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if p.returncode:
        sys.exit(f"dflash train failed ({p.returncode}): {p.stderr[-2000:]}")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["elapsed_s"] -
                                                          rows[0]["elapsed_s"])
    return {"steady": steady, "whole": summary["tokens"] / summary["elapsed_s"],
            "cpu": summary["tokens"] / cpu,
            "wait": summary.get("spool_wait_s", 0.0), "steps": len(rows),
            "model": (out / "model.safetensors").read_bytes()}


# The readers alone, as the CPU trainer calls them (float32 rows, NaN/Inf and zero-layer checks):
# the offline sample stream (its prefetch thread included) and the spool consumer, over the same
# samples; CPU seconds of this process per token.
READER = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
mode, data, where = sys.argv[2], sys.argv[3], sys.argv[4]
P = ctypes.c_void_p
class SpoolOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("wait_s", ctypes.c_double),
                ("reuse", ctypes.c_int32), ("stored_rows", ctypes.c_int32)]
class Sample(ctypes.Structure):  # dflash_sample: len is what we read
    _fields_ = [("struct_size", ctypes.c_size_t), ("index", ctypes.c_uint64), ("id", P),
                ("len", ctypes.c_int64), ("pad", ctypes.c_char * 256)]
def check(rc, what):
    if rc:
        lib.dflash_last_error.restype = ctypes.c_char_p
        sys.exit(f"{what}: status {rc}: {lib.dflash_last_error()}")
t0, tokens, end = time.process_time(), 0, ctypes.c_int()
if mode == "spool":
    o = SpoolOpts()
    lib.dflash_spool_options_init(ctypes.byref(o), ctypes.c_size_t(ctypes.sizeof(o)))
    o.wait_s = 10.0
    sp = P()
    check(lib.dflash_spool_open(where.encode(), ctypes.byref(o), ctypes.byref(sp)), "open")
    smp = Sample()
    smp.struct_size = 112  # sizeof(dflash_sample) on LP64
    while True:
        check(lib.dflash_spool_next(sp, ctypes.byref(smp), ctypes.byref(end)), "next")
        if end.value:
            break
        tokens += smp.len
    lib.dflash_spool_free(sp)
else:
    st = P()
    lib.dflash_sample_stream_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, P, P]
    check(lib.dflash_sample_stream_open(data.encode(), where.encode(), None, ctypes.byref(st)),
          "stream")
    lib.dflash_sample_stream_count.restype = ctypes.c_size_t
    n = lib.dflash_sample_stream_count(st)
    order = (ctypes.c_uint64 * n)(*range(n))
    check(lib.dflash_sample_stream_start(st, order, ctypes.c_size_t(n)), "start")
    smp = Sample()
    smp.struct_size = 112  # sizeof(dflash_sample) on LP64
    while True:
        check(lib.dflash_sample_stream_next(st, ctypes.byref(smp), ctypes.byref(end)), "next")
        if end.value:
            break
        tokens += smp.len
    lib.dflash_sample_stream_free(st)
print(tokens, time.process_time() - t0)
"""


def reader_cpu(lib, mode, data, where, env):
    """CPU seconds per token of reading every sample (one epoch) with the library alone."""
    out = subprocess.run([sys.executable, "-c", READER, lib, mode, str(data), where], env=env,
                         check=True, stdout=subprocess.PIPE, text=True).stdout.split()
    return float(out[1]) / int(out[0])


def order_of(trace):
    lines = [x.split() for x in open(trace) if not x.startswith("#")]
    return "".join(f"{e} {sid}\n" for e, _, sid in lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cli", required=True, help="the dflash command (BUILD/tools/dflash/dflash)")
    ap.add_argument("--samples", type=int, default=96, help="training samples (96)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs (2)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each; medians (3)")
    ap.add_argument("--threads", type=int, default=1, help="trainer threads (1)")
    ap.add_argument("--s3", action="store_true", help="the spool on moto (s3://), not a folder")
    ap.add_argument("--concurrent", action="store_true",
                    help="the producer runs beside the trainer with a quarter-epoch budget")
    a = ap.parse_args()
    cli = str(pathlib.Path(a.cli).resolve())
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="spool-train-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if a.s3:
        sys.path.insert(0, str(HERE))
        import s3_read
        url = s3_read.start_moto()
        env.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=s3_read.KEY_ID,
                   AWS_SECRET_ACCESS_KEY=s3_read.SECRET, AWS_REGION=s3_read.REGION,
                   DFLASH_S3_ADDRESSING="path")
        env.pop("AWS_SESSION_TOKEN", None)
        s3_read.s3_client(url).create_bucket(Bucket=s3_read.BUCKET)
    epoch_bytes = make_world(tmp, a.samples, np.random.default_rng(0))
    # The order of the offline run, for the producer.
    trace = tmp / "offline.trace"
    train(cli, tmp, str(tmp / "store"), tmp / "offline", a, dict(env, DFLASH_TRAIN_TRACE=str(trace)))
    (tmp / "order.txt").write_text(order_of(trace))
    shard = max(1 << 20, epoch_bytes // 16)
    budget = (epoch_bytes // 4 if a.concurrent else (a.epochs + 1) * epoch_bytes) + 2 * shard
    off, sp, rd_off, rd_sp = [], [], [], []
    lib = os.environ.get("DFLASH_LIBRARY") or str(pathlib.Path(cli).parents[2] / "libdflash.so")
    for rep in range(a.reps):
        off.append(train(cli, tmp, str(tmp / "store"), tmp / "offline", a, env))
        where = (f"s3://{s3_read.BUCKET}/spool{rep}" if a.s3 else str(tmp / f"spool{rep}"))
        prod = [sys.executable, str(PRODUCER), where, str(tmp / "store"), str(tmp / "order.txt"),
                str(shard), str(budget), "0", str(a.epochs), str(tmp / "producer.log")]
        penv = dict(env, PYTHONPATH=str(ROOT / "bindings" / "python"))
        if a.concurrent:
            p = subprocess.Popen(prod, env=penv, stderr=subprocess.PIPE, text=True)
            sp.append(train(cli, tmp, "spool:" + where, tmp / "spool-run", a, env))
            if p.wait(timeout=600):
                sys.exit(f"producer failed: {p.stderr.read()[-2000:]}")
        else:
            subprocess.run(prod, env=penv, check=True)
            # The readers alone first (reading a spool deletes nothing; the trainer's run does).
            rd_off.append(reader_cpu(lib, "store", tmp / "train", str(tmp / "store"), env))
            rd_sp.append(reader_cpu(lib, "spool", tmp / "train", where, env))
            sp.append(train(cli, tmp, "spool:" + where, tmp / "spool-run", a, env))
        if sp[-1]["model"] != off[-1]["model"]:
            sys.exit("the spool run did not end at the offline run's checkpoint")
    med = {k: (statistics.median(r[k] for r in off), statistics.median(r[k] for r in sp))
           for k in ("steady", "whole", "cpu", "wait")}
    print(f"demo shape (hidden {H}, vocab {VOCAB}, K {len(TARGET_LAYERS)}), {a.samples} samples "
          f"({epoch_bytes / 2**20:.1f} MiB of bf16 hidden states an epoch), {a.epochs} epochs, "
          f"{off[0]['steps']} steps, batch 4, {a.threads} thread(s); spool: "
          f"{'s3:// on moto' if a.s3 else 'local folder'}, shards {shard / 2**20:.2f} MiB, "
          f"{'producer beside the trainer, budget ' + format(budget / 2**20, '.1f') + ' MiB' if a.concurrent else 'published ahead'}"
          f"; median of {a.reps}; same checkpoint: yes")
    print(f"  {'':28} {'offline':>9} {'spool':>9} {'spool/offline':>14}")
    for k, label in (("steady", "tokens/s (steps 2..N)"), ("whole", "tokens/s (whole run)"),
                     ("cpu", "tokens per trainer CPU-s")):
        print(f"  {label:28} {med[k][0]:9.1f} {med[k][1]:9.1f} {med[k][1] / med[k][0]:14.3f}")
    print(f"  {'trainer waited for shards':28} {'':9} {med['wait'][1]:8.2f}s")
    if rd_off:
        r_off, r_sp = statistics.median(rd_off), statistics.median(rd_sp)
        step = 1 / med["cpu"][0]  # the offline trainer's CPU-s per token
        print(f"  {'reader alone, CPU-us/token':28} {r_off * 1e6:9.2f} {r_sp * 1e6:9.2f}"
              f"   (trainer: {step * 1e6:.0f} CPU-us/token)")
        print(f"  predicted spool/offline throughput of a CPU-bound trainer: "
              f"{step / (step - r_off + r_sp):.4f}")
    for k in ("steady", "cpu"):
        print(f"  runs ({'tokens/s' if k == 'steady' else 'tokens per CPU-s'}): offline " +
              " ".join(f"{r[k]:.0f}" for r in off) + "; spool " +
              " ".join(f"{r[k]:.0f}" for r in sp))
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
