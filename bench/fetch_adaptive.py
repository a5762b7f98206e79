#!/usr/bin/env python3
"""Does `dflash fetch` keep each server at its best throughput with default flags?

Scenarios S1-S7 (fetch_sim.py) against the simulated servers
of bench/fetch_sim.py (step-time model, vLLM/SGLang/llama.cpp policies, their real
load endpoints) on a sped-up clock. Per scenario:
  best fixed: the fixed per-server concurrency vector with the highest rate, swept
              over the spec's grid (refined +-25 %) by an ideal closed-loop client in
              virtual time (no sockets: an upper bound of any fixed-concurrency client);
  default:    the real `dflash fetch` CLI with default flags against the live servers;
  fixed 64:   the same CLI with --concurrency 64 (what the peers do).
T = completed output tokens per simulated second between 10 % and 90 % of the
prompts done; M = T_default / T_best_fixed, M_fixed64 = T_fixed64 / T_best_fixed.
Secondary: makespan ratio, preemptions + retractions per 1,000 completions (default
over best fixed), time to 95 % of the best rate after start (and after the drift or
slowdown in S4/S5), client CPU seconds (default over fixed 64).

usage: python3 bench/fetch_adaptive.py [--cli build/tools/dflash/dflash] [--quick]
           [--scenario S1 ...] [--json]
The last line with --json is one JSON object {"scenarios": {name: {"M", "M_fixed64",
"preempt_ratio", ...}}}.
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fetch_sim as sim  # noqa: E402

GPU4 = ["kimi-pcie-bf16", "kimi-pcie-fp8", "kimi-pcie-noP2P", "h200-fast"]
# name: presets, drift, events [(fraction done, kind, server, arg)], metrics endpoints
SCENARIOS = {
    "S1": (["kimi-pcie-bf16"], False, [], True),
    "S2": (["kimi-pcie-fp8"], False, [], True),
    "S3": (GPU4, False, [], True),
    "S4": (["kimi-pcie-bf16"], True, [], True),
    "S5": (GPU4, False, [(0.4, "slow", 0, (1.8, 60.0)), (0.6, "restart", 3, 15.0)], True),
    "S6": (["kimi-pcie-bf16", "kimi-pcie-fp8"], False, [], False),
    "S7": (["llamacpp-8slot"], False, [], True),
}
GRID = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512]
# prompts per server (about 30 request lifetimes at the knee) and the clock
# (the clock runs as fast as a target wall time per run allows, at most MAX_EVENTS
# streamed tokens per real second so the simulated servers keep time on a busy CPU)
SIZES = {"quick": {"scale": 32, "n": 900, "wall": 20},
         "full": {"scale": 32, "n": 2500, "wall": 60}}
MAX_EVENTS = 5000
# a faster server gets more prompts, so that every run holds about as many request
# lifetimes at each server's best (the 10-90 % window must dwarf the controller's start)
PROMPTS = {"kimi-pcie-bf16": 1.0, "kimi-pcie-fp8": 2.5, "kimi-pcie-noP2P": 0.7,
           "h200-fast": 3.0, "llamacpp-8slot": 0.5}


def best_rate(presets, conc, work, scale, events):
    log, engines = sim.closed_loop(presets, conc, work, scale, events)
    return sim.rate_10_90(log, len(work)), log, engines


def sweep(presets, work, scale, events):
    """The best fixed vector: each server alone over the grid, then the vector refined
    +-25 % one server at a time with all of them together."""
    vec = []
    for p in presets:
        rates = [(best_rate([p], [c], work, scale, [])[0], c) for c in GRID]
        vec.append(max(rates, key=lambda rc: (rc[0], -rc[1]))[1])
    best, log, engines = best_rate(presets, vec, work, scale, events)
    for i in range(len(presets)):
        for f in (0.75, 1.25):
            v = list(vec)
            v[i] = max(1, round(v[i] * f))
            r, lg, en = best_rate(presets, v, work, scale, events)
            if r > best:
                best, vec, log, engines = r, v, lg, en
    return best, vec, log, engines


def write_input(path, work):
    with open(path, "w") as f:
        for i, (p, o) in enumerate(work):
            f.write(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": f"prompt {i} [[sim:{p},{o}]]"}]}) + "\n")


def live_run(cli, presets, work, size, events, metrics, extra, tmp, tag):
    """The CLI against live simulated servers; the completion log and client CPU."""
    live = sim.Live(presets, size["scale"], size["speed"], metrics=metrics, total=len(work),
                    events=events)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    ports = []

    def serve():
        asyncio.set_event_loop(loop)
        ports.extend(loop.run_until_complete(live.start()))
        ready.set()
        loop.run_forever()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    ready.wait()
    inp = os.path.join(tmp, "in.jsonl")
    if not os.path.exists(inp):
        write_input(inp, work)
    out = os.path.join(tmp, tag)
    cmd = [cli, "fetch", inp, "-o", out, "--model", "sim", "--max-tokens",
           str(sim.MAX_TOKENS // size["scale"]), "--log-interval", "3600"]
    for p in ports:
        cmd += ["--server", f"http://127.0.0.1:{p}/v1"]
    t0 = time.monotonic()
    pr = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(pr.pid, 0)
    wall = time.monotonic() - t0
    summary = pr.stdout.read().decode()
    err = pr.stderr.read().decode()
    pr.stdout.close()
    pr.stderr.close()
    loop.call_soon_threadsafe(live.stop, loop)
    th.join(5)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"dflash fetch {tag} exited {rc}: {err[-2000:]}")
    log = [(t, o) for t, o, _ in live.log]
    try:
        summ = json.loads(summary)
    except ValueError:
        summ = {}
    return {"log": log, "engines": live.engines, "cpu": ru.ru_utime + ru.ru_stime,
            "wall": wall, "summary": summ, "t0": live.log and min(t for t, _ in log)}


def time_to(log, target, after):
    """Simulated seconds from `after` until the completed-token rate over a sliding window
    of ~one twentieth of the run first reaches `target`; None when never."""
    log = sorted(log)
    if not log:
        return None
    span = log[-1][0] / 20
    j = 0
    acc = 0
    for i, (t, o) in enumerate(log):
        acc += o
        while log[j][0] < t - span:
            acc -= log[j][1]
            j += 1
        if t - span >= after and acc / span >= target:
            return t - span - after
    return None


def preempts(engines):
    return sum(e.preemptions for e in engines)


def run_scenario(name, cli, size, tmp):
    presets, drift, events, metrics = SCENARIOS[name]
    n = round(size["n"] * sum(PROMPTS[p] for p in presets))
    work = sim.workload(n, size["scale"], drift)
    t = time.monotonic()
    best, vec, blog, bengines = sweep(presets, work, size["scale"], events)
    sweep_s = time.monotonic() - t
    makespan = max(t for t, _ in blog)
    size = dict(size, speed=max(0.25, min(makespan / size["wall"], MAX_EVENTS / best)))
    d = live_run(cli, presets, work, size, events, metrics, [], tmp, "default")
    f64 = live_run(cli, presets, work, size, events, metrics, ["--concurrency", "64"], tmp,
                   "fixed64")
    td = sim.rate_10_90(d["log"], n)
    t64 = sim.rate_10_90(f64["log"], n)
    per_k = lambda eng, lg: 1000 * preempts(eng) / max(1, len(lg))  # noqa: E731
    pb, pd, p64 = per_k(bengines, blog), per_k(d["engines"], d["log"]), \
        per_k(f64["engines"], f64["log"])
    mk = lambda lg: max(t for t, _ in lg) - min(t for t, _ in lg) if lg else 0  # noqa: E731
    r = {"M": round(td / best, 3), "M_fixed64": round(t64 / best, 3),
         "preempt_ratio": round((pd + 1) / (pb + 1), 2),
         "preempt_per_1k": {"default": round(pd, 1), "best_fixed": round(pb, 1),
                            "fixed64": round(p64, 1)},
         "best_fixed": vec, "tok_per_s": {"best_fixed": round(best, 1),
                                          "default": round(td, 1), "fixed64": round(t64, 1)},
         "makespan_ratio": round(mk(d["log"]) / mk(blog), 3) if blog else None,
         "t95_start_s": time_to(d["log"], 0.95 * best, 0),
         "cpu_ratio": round(d["cpu"] / f64["cpu"], 2) if f64["cpu"] else None,
         "client_cpu_s": {"default": round(d["cpu"], 2), "fixed64": round(f64["cpu"], 2)},
         "speed": round(size["speed"], 2), "wall_s": round(d["wall"] + f64["wall"] + sweep_s, 1),
         "final_concurrency": [s.get("concurrency") for s in d["summary"].get("servers", [])]}
    if drift or events:
        # the simulated time the event happened in the default run
        frac = 0.5 if drift else events[0][0]
        lg = sorted(d["log"])
        at = lg[int(frac * len(lg))][0] if lg else 0
        r["t95_event_s"] = time_to([x for x in lg if x[0] >= at], 0.95 * best, at)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cli", default=None, help="the dflash binary (default: build*/tools)")
    ap.add_argument("--quick", action="store_true", help="CI scale")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--json", action="store_true", help="a JSON object as the last line")
    ap.add_argument("--min-m", type=float, default=0,
                    help="exit 1 when a scenario's M is below this")
    a = ap.parse_args()
    cli = a.cli or os.environ.get("DFLASH_CLI")
    if not cli:
        for b in ("build", "build-dev", "build-release"):
            c = os.path.join(HERE, "..", b, "tools", "dflash", "dflash")
            if os.path.exists(c):
                cli = c
                break
    if not cli:
        raise SystemExit("no dflash binary: give --cli")
    size = SIZES["quick" if a.quick else "full"]
    names = a.scenario or sorted(SCENARIOS)
    res = {}
    tmp = tempfile.mkdtemp(prefix="fetch-adaptive-")
    try:
        for nm in names:
            d = os.path.join(tmp, nm)
            os.makedirs(d)
            res[nm] = run_scenario(nm, cli, size, d)
            r = res[nm]
            print(f"{nm}: M {r['M']:.3f}  M_fixed64 {r['M_fixed64']:.3f}  best fixed "
                  f"{r['best_fixed']} ({r['tok_per_s']['best_fixed']:.0f} tok/s)  default "
                  f"{r['tok_per_s']['default']:.0f} tok/s  makespan {r['makespan_ratio']}  "
                  f"preempt/1k {r['preempt_per_1k']['default']} vs {r['preempt_per_1k']['best_fixed']}"
                  f"  t95 {r['t95_start_s']}  cpu x{r['cpu_ratio']}  final "
                  f"{r['final_concurrency']}  ({r['wall_s']} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps({"scale": size, "scenarios": res}))
    bad = [k for k, r in res.items() if r["M"] < a.min_m]
    if bad:
        print(f"M below {a.min_m}: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
