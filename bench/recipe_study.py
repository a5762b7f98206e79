#!/usr/bin/env python3
"""The recipe study: libdflash's training recipe, one factor at a time.

    nice -n 15 python3 bench/recipe_study.py --out OUT --build BUILD [--arch dflash|dflash2]
        [--seeds 0,1] [--epochs 2] [--jobs 2] [--only default,anchors32,...] [--dry-run]

OUT is a demo output folder (examples/pipeline/pipeline.py) with target/, data/{train,heldout}
and hidden/{train,heldout} (the training store with the target's greedy ids,
dump_hidden.py --target-ids, for the labels row). Every config below changes one knob of
today's default (`dflash train --anchors 8 --lr 3e-3 --warmup-ratio 0.05`, cosine schedule,
gamma-decay weights, data labels, AdamW) and is trained once per seed with `dflash train`,
then scored with `dflash eval --max-tokens 128` on the held-out set: the walk tau (what greedy
speculative decoding gets) +- its SE over samples. Runs land in OUT/recipe/ARCH/NAME-sSEED/
and a finished run is not trained again, so the study resumes. It prints one row per config
and seed, then per config the mean over seeds +- SE (sqrt(mean of the squared eval SEs +
the seeds' variance) / sqrt(seeds)) and the difference from the default +- the two SEs
combined; the last line is a JSON object {arch: {config: {"tau", "se", "diff", "diff_se",
"cpu_s_per_step", "seeds": [...]}}}.

The muon config is speculators' optimizer recipe (vLLM speculators 0.9.0's defaults for
--optimizer muon): torch.optim.Muon on the weight matrices with lr 1e-3, Nesterov momentum
0.95, decoupled weight decay 0.1 and the match_rms_adamw step scale (dflash train's Muon
defaults), AdamW with lr 1e-3 and weight decay 0.01 on the rest (here the norms). Its
schedule stays the default's (speculators' is linear: the linear row measures that knob).
--dry-run prints each run's `dflash train` command and runs nothing.

    python3 bench/recipe_study.py --out DIR --build BUILD --optimizer-cost [--steps 10]

times the optimizers alone, no demo needed: in DIR a synthetic store at the demo drafter's
shape (SmolLM2: hidden 576, intermediate 1536, 9/3 heads of 64, vocabulary 49152, target
layers 1/14/27, block 8, one layer; 24 random samples of 160 tokens), then `dflash train
--anchors 8 --threads 1` with --optimizer adamw and muon, twice each; CPU-s per step is the
difference of a 2-step and a (2 + steps)-step run (start-up cancels), from wait4.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPE = os.path.join(ROOT, "examples", "pipeline")

# The study's baseline (the demo's recipe when the study began): every config below is this plus one change.
BASE = ["--anchors", "8", "--lr", "3e-3", "--warmup-ratio", "0.05"]
CONFIGS = {  # in the order the study runs them
    "default": [],
    "weights_none": ["--weighting", "none"],
    "anchors32": ["--anchors", "32"],
    "weights_adaptive": ["--weighting", "adaptive"],
    "lr1e-2": ["--lr", "1e-2"],
    "linear": ["--schedule", "linear"],
    "constant": ["--schedule", "constant"],
    "lr1e-3": ["--lr", "1e-3"],
    "anchors_all": ["--anchors", "512"],  # every valid position (answers are <= 128 tokens)
    "labels_target": ["--labels", "target"],  # needs dump_hidden.py --target-ids
    "muon": ["--optimizer", "muon", "--lr", "1e-3", "--weight-decay", "0.01"],  # speculators'
}


def args_of(name):
    """BASE with CONFIGS[name]'s flags replacing BASE's own."""
    extra = CONFIGS[name]
    out, keys = [], set(extra[0::2])
    for k, v in zip(BASE[0::2], BASE[1::2]):
        if k not in keys:
            out += [k, v]
    return out + extra


def write_config(out, arch):
    """The demo's drafter config (pipeline.drafter_config; DFlash 2: dflash2_config)."""
    sys.path.insert(0, PIPE)
    import pipeline
    from target import Target
    cfg = pipeline.drafter_config(Target(), [1, 14, 27], 8)
    if arch == "dflash2":
        cfg = pipeline.dflash2_config(cfg)
    path = os.path.join(out, "recipe", f"{arch}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def run_timed(cmd, log):
    """Run cmd (stdout to the caller), its CPU seconds (user + system) from wait4."""
    with open(log, "a") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        lf.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=lf, text=True)
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{cmd[1]} failed ({p.returncode}): see {log}")
    return out, ru.ru_utime + ru.ru_stime


def run_dir(a, name, seed):
    return os.path.join(a.out, "recipe", a.arch, f"{name}-s{seed}")


def train_cmd(a, cfg_path, name, seed):
    """The `dflash train` command of one config and seed."""
    cli = os.path.join(a.build, "tools", "dflash", "dflash")
    return [cli, "train", "--config", cfg_path, "--target", os.path.join(a.out, "target"),
            "--data", os.path.join(a.out, "data", "train"),
            "--hidden", os.path.join(a.out, "hidden", "train"),
            "-o", os.path.join(run_dir(a, name, seed), "drafter"),
            "--epochs", str(a.epochs), "--seed", str(seed), "--threads", str(a.threads),
            "--overwrite", "--quiet"] + args_of(name)


def one_run(a, cfg_path, name, seed):
    """Train and evaluate one config and seed (skipped when its result exists)."""
    d = run_dir(a, name, seed)
    res = os.path.join(d, "result.json")
    if os.path.exists(res):
        with open(res) as f:
            return json.load(f)
    os.makedirs(d, exist_ok=True)
    cli = os.path.join(a.build, "tools", "dflash", "dflash")
    ckpt = os.path.join(d, "drafter")
    train = train_cmd(a, cfg_path, name, seed)
    t0 = time.time()
    out, cpu = run_timed(train, os.path.join(d, "log.txt"))
    wall = time.time() - t0
    tr = json.loads(out)
    ev, ecpu = run_timed([cli, "eval", "--checkpoint", ckpt, "--target",
                          os.path.join(a.out, "target"),
                          "--data", os.path.join(a.out, "data", "heldout"),
                          "--hidden", os.path.join(a.out, "hidden", "heldout"),
                          "--max-tokens", "128", "--threads", str(a.threads), "--json"],
                         os.path.join(d, "log.txt"))
    e = json.loads(ev)
    r = {"config": name, "seed": seed, "args": args_of(name), "epochs": a.epochs,
         "tau": e["walk_tau"], "se": e["walk_tau_se"], "steps_walk": e["steps"],
         "position_tau": e["position_tau"], "accuracy": e["accuracy"],
         "train_steps": tr["steps"], "final_loss": tr.get("final_loss"),
         "train_cpu_s": round(cpu, 1), "train_wall_s": round(wall, 1),
         "cpu_s_per_step": round(cpu / max(tr["steps"], 1), 4), "eval_cpu_s": round(ecpu, 1)}
    with open(res, "w") as f:
        json.dump(r, f, indent=2)
    print(f"{a.arch} {name} seed {seed}: walk tau {r['tau']:.4f} +- {r['se']:.4f}, "
          f"{r['train_steps']} steps, {r['cpu_s_per_step']} CPU-s/step", flush=True)
    return r


SMOL_DRAFTER = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 1, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "num_target_layers": 30,
                "block_size": 8, "tie_word_embeddings": True,
                "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 14, 27]}}


def synthetic_store(root):
    """SMOL_DRAFTER's config, a random target (embed = LM head) and 24 samples."""
    import numpy as np
    import libdflash
    from libdflash.hidden import write_dataset
    H, V, K, S = 576, 49152, 3, 160
    if os.path.exists(os.path.join(root, "drafter.json")):
        return
    rng = np.random.default_rng(0)
    samples = []
    with libdflash.HiddenWriter(os.path.join(root, "hidden"), num_layers=K, hidden_size=H) as w:
        for i in range(24):
            mask = np.ones(S, np.uint8)
            mask[:32] = 0
            samples.append((f"s{i}", rng.integers(0, V - 1, S).astype(np.int32), mask))
            w.append(f"s{i}", rng.standard_normal((S, K * H)).astype(np.float32))
    write_dataset(os.path.join(root, "data"), samples)
    os.makedirs(os.path.join(root, "target"), exist_ok=True)
    e = (0.02 * rng.standard_normal((V, H))).astype(np.float32)
    libdflash.write_safetensors(os.path.join(root, "target", "model.safetensors"),
                                {"model.embed_tokens.weight": e, "lm_head.weight": e})
    with open(os.path.join(root, "drafter.json"), "w") as f:
        json.dump(SMOL_DRAFTER, f)


def optimizer_cost(a):
    """CPU-s per step of `dflash train` with AdamW and Muon on synthetic_store."""
    synthetic_store(a.out)
    cli = os.path.join(a.build, "tools", "dflash", "dflash")

    def cpu(opt, n):
        cmd = [cli, "train", "--config", os.path.join(a.out, "drafter.json"),
               "--target", os.path.join(a.out, "target"), "--data", os.path.join(a.out, "data"),
               "--hidden", os.path.join(a.out, "hidden"), "-o", os.path.join(a.out, "run-" + opt),
               "--epochs", "1", "--max-steps", str(n), "--anchors", "8", "--threads", "1",
               "--overwrite", "--quiet", "--optimizer", opt]
        return run_timed(cmd, os.path.join(a.out, "log.txt"))[1]

    out = {}
    for opt in ("adamw", "muon", "adamw", "muon"):
        per = (cpu(opt, 2 + a.steps) - cpu(opt, 2)) / a.steps
        out.setdefault(opt, []).append(round(per, 3))
        print(f"{opt}: {per:.3f} CPU-s/step", flush=True)
    print(json.dumps(out))


def summarize(rows):
    """Per config: mean tau over seeds and its SE (eval SE and seed spread together)."""
    n = len(rows)
    mean = sum(r["tau"] for r in rows) / n
    var_seed = sum((r["tau"] - mean) ** 2 for r in rows) / (n - 1) if n > 1 else 0.0
    var_eval = sum(r["se"] ** 2 for r in rows) / n
    return mean, math.sqrt((var_eval + var_seed) / n)


def table(arch, results, names):
    print(f"\n{arch}: walk tau on the held-out set, per seed and per config")
    print(f"| config | flags | seed | walk tau +- SE | every-position tau | final loss | "
          f"steps | CPU-s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for r in results[name]:
            print(f"| {name} | `{' '.join(CONFIGS[name]) or '(today)'}` | {r['seed']} | "
                  f"{r['tau']:.4f} +- {r['se']:.4f} | {r['position_tau']:.4f} | "
                  f"{r['final_loss']:.3f} | {r['train_steps']} | {r['cpu_s_per_step']} |")
    out = {}
    base = summarize(results["default"]) if "default" in results else None
    print(f"\n| config | seeds | mean walk tau +- SE | minus default +- SE | CPU-s/step |")
    print("|---|---|---|---|---|")
    for name in names:
        m, se = summarize(results[name])
        cps = sum(r["cpu_s_per_step"] for r in results[name]) / len(results[name])
        d, dse = (m - base[0], math.hypot(se, base[1])) if base else (0.0, 0.0)
        tag = "" if name == "default" else (" (beyond 1 SE)" if abs(d) > dse else "")
        print(f"| {name} | {len(results[name])} | {m:.4f} +- {se:.4f} | "
              f"{d:+.4f} +- {dse:.4f}{tag} | {cps:.3f} |")
        out[name] = {"tau": round(m, 4), "se": round(se, 4), "diff": round(d, 4),
                     "diff_se": round(dse, 4), "cpu_s_per_step": round(cps, 4),
                     "seeds": [round(r["tau"], 4) for r in results[name]]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the demo's output folder")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="runs at the same time")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    ap.add_argument("--only", default=",".join(CONFIGS), help="configs, comma-separated")
    ap.add_argument("--config", default=None,
                    help="drafter config.json (default: the demo's, from the target)")
    ap.add_argument("--optimizer-cost", action="store_true",
                    help="time adamw vs muon on a synthetic store in --out, nothing else")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (--optimizer-cost)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each run's dflash train command, run nothing")
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)
    names = [n for n in a.only.split(",") if n]
    for n in names:
        if n not in CONFIGS:
            raise SystemExit(f"unknown config {n!r} (known: {', '.join(CONFIGS)})")
    os.environ.setdefault("DFLASH_LIBRARY", os.path.join(a.build, "libdflash.so"))
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    if a.optimizer_cost:
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
        os.makedirs(a.out, exist_ok=True)
        return optimizer_cost(a)
    if a.dry_run:
        cfg = os.path.abspath(a.config) if a.config else \
            os.path.join(a.out, "recipe", f"{a.arch}.json")
        for n in names:
            for s in a.seeds.split(","):
                print(" ".join(train_cmd(a, cfg, n, int(s))))
        return
    os.environ.setdefault("DFLASH_LIBRARY", os.path.join(a.build, "libdflash.so"))
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    cfg_path = os.path.abspath(a.config) if a.config else write_config(a.out, a.arch)
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = [(n, s) for n in names for s in seeds]  # config by config: a cut-short study
    # still has every seed of the configs it reached
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(a.threads)
    with ThreadPoolExecutor(a.jobs) as ex:
        done = list(ex.map(lambda j: one_run(a, cfg_path, *j), jobs))
    results = {n: [r for r in done if r["config"] == n] for n in names}
    print(json.dumps({a.arch: table(a.arch, results, names)}))


if __name__ == "__main__":
    main()
